"""The device data path of low-latency mode: kernels store rows straight into the peers' IPC-mapped
regions and poll signal words, with no host synchronisation inside a call.

# Note [Low-latency device path]
A call launches its kernels on the caller's stream and returns: nothing waits on the host, so a
dispatch + hook + combine + hook can be captured in a CUDA graph and replayed. An eager call's
latency is its host time plus its kernel's, so each kind of call (phase, flags, parity, id dtype)
launches through a ``PackedLaunch`` made after its first launch (ep.kernels.launch): its
parameters packed once, a call's addresses and sizes patched in by compiled code (no Triton
launcher, no per-argument specialization), the kernels' ints left unspecialized so that one
compiled kernel serves every call of the kind. A send made so also packs its receive's launch
(the same kernel arguments, the receive's kind and grid) into the receive's ``PackedLaunch``,
so that its hook, the latency of a decode step's receive, is the driver's launch and no more:
that packed launch waits there until the hook, and the rounds rule (Note [Low-latency rounds])
keeps another send of the kind from packing over it first. The common eager call (the flags
DeepEP's callers pass, tensors as the kernels read them) is one compiled call from there
(``dispatch_made``, ``combine_made``): the tensors' acceptance, the combine's output and the
launch; anything else declines to the runtime's full checks, which name what is wrong.

Two kernels (ep.low_latency._triton_dispatch and _triton_combine), ``dispatch`` and ``combine``,
each a send phase and a receive phase: a call without a hook launches one kernel running both (at most a
program per SM, so that every program that waits in the receive lets the others send), a call
with one launches the send and leaves the receive to the hook. A one-launch dispatch's program
fills its SM, so two calls without hooks on two streams at once run one after the other on each
GPU; ranks that start them in opposite orders wait for each other until the timeout (DeepEP's
cooperative launches share this). Overlapped micro-batches take hooks, whose sends never wait.

- dispatch, send: every program reads all of ``topk_idx`` (a few KB): an expert id out of range
  refuses the round on all of them alike, and each (token, column) gets its slot, its rank among
  this rank's entries to the same expert in token order, without a count exchange or a kernel
  before; each token is cast (FP8 on request) and stored into slot ``(e, this rank)`` of each of
  its experts' ranks (ep.low_latency._layout), all its rows at once, once those slots' acks came.
  The last program to finish (a per-phase counter in the device state) writes the signal word of
  every (rank, local expert): ``seq << 32 | tag << 24 | count``, where ``seq`` is this parity's
  dispatch sequence number and ``tag`` the call's arguments (``call_tag``); a refused input sends
  the count ``0xFFFFFF`` instead of rows;
- dispatch, receive: each (local expert, source) spins on the signal words with the Buffer's
  timeout as a ``%globaltimer`` deadline, then packs the rows into the outputs, whose addresses
  are fixed per parity, and writes "received seq" into its ack word at the source (one per
  receiving rank and local expert: a program acks its own slot, no count of the programs first);
- combine: the same two phases, rows stored at ``t * K + k`` in their source, one signal word per
  expert rank, and the weighted sum in the receive (a token's rows read all at once, a block of
  columns a step: one memory latency a step, not one a row); its last program acks each rank.

A parity's sequence numbers live in device memory (the state words) and only the kernels advance
them, so a graph replay is a new round. Before a send stores into a rank it waits for that
rank's acks of this parity's previous round (the same two-rounds-in-flight rule as the host path,
Note [Low-latency rounds]), so a rank running ahead never overwrites what a peer has not read.
The acks are relaxed stores (``acknowledge`` says why): acknowledging a read orders no data.

Failures cannot raise inside a call. A kernel whose wait times out marks the device state failed
(every later kernel then does nothing) and writes a code, the round and the rank it waited for
into a pinned host word; an argument mismatch between ranks, a refused input or a combine that
unmasks an entry writes its code there too but keeps the group going. The next call reads that
word on the host and raises (``failure``; ep.low_latency._failures): ``TransferTimeout`` or
``PeerLostError`` (after a liveness check) for good, ``ConfigError`` once. Synchronising the
stream before the next call makes that call the one that raises.

With ``shrink`` (DeepEP's ``enable_shrink``) a wait past its deadline instead masks the ranks it
waited for in a device word per rank (DeepEP's mask buffer): no kernel waits for, sends to or
reads from a masked rank again, a receive reads the rank's rows as absent (a combine sums a token
without the rows of experts on masked ranks), and the calls go on; the mask is read after every
wait, so the programs of one call agree on it. A rank comes back only through
``update_mask`` (then ``clean_low_latency_buffer``, on every rank).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from warmlink.ep.kernels.launch import FastLaunch, current_stream, launch
from warmlink.ep.low_latency import _failures
from warmlink.ep.low_latency._layout import LowLatencyLayout
from warmlink.ep.low_latency._outputs import Outputs
from warmlink.errors import ConfigError

__all__ = ["BOTH", "RECV", "SEND", "DevicePath", "build_kernels", "call_tag"]

STATE_WORDS = 16  # seq of (dispatch, combine) x parity, failed, spare, done counters (_triton)
SEND, RECV, BOTH = 1, 2, 3  # a kernel's PHASE: a call without a hook launches both phases at once
_SCAN_BLOCK = 256  # topk_idx entries a dispatch program compares at a time
_WARPS = {("dispatch", SEND): 8, ("dispatch", RECV): 4, ("dispatch", BOTH): 8,
          ("combine", SEND): 4, ("combine", RECV): 4, ("combine", BOTH): 8}


# The launch arguments that change from call to call, by name (the others are the parity's, ``_fixed``,
# or a tensor standing in for absent stats), by (cumulative stats given, wait stats given) for the
# dispatch and by wait stats given for the combine; the kernels leave their ints unspecialized
# (do_not_specialize), so one compiled kernel serves every value.
_DISPATCH_CALL = {"x_ptr", "topk_ptr", "num_tokens", "num_cols", "tokens", "tag"}
_DISPATCH_VARYING = {(cum, wait): frozenset(_DISPATCH_CALL | ({"cum_stats_ptr"} if cum else set())
                                            | ({"wait_stats_ptr"} if wait else set()))
                     for cum in (False, True) for wait in (False, True)}
_COMBINE_CALL = {"x_ptr", "range_ptr", "comb_slot_ptr", "topk_ptr", "w_ptr", "dispatched_ptr", "out_ptr", "per_expert",
                 "num_tokens", "num_cols", "tag"}
_COMBINE_VARYING = {wait: frozenset(_COMBINE_CALL | ({"wait_stats_ptr"} if wait else set())) for wait in (False, True)}


def _rows_a_step(w_block: int) -> int:
    """Rows a dispatch's receive or a combine's send moves a step: about 8192 int64 words in flight
    a program (8 FP8 rows of 7168, 4 BF16 ones), at most 8."""
    return max(1, min(8, 8192 // w_block))


def call_tag(tokens: int, fp8: bool, round_scale: bool, ue8m0: bool) -> int:
    """The 8 bits of a dispatch's arguments its signal words carry: ranks whose ``use_fp8``,
    ``round_scale`` or ``use_ue8m0`` differ, or whose ``num_max_dispatch_tokens_per_rank`` differs
    by other than a multiple of 32, are told apart."""
    return fp8 | round_scale << 1 | ue8m0 << 2 | (tokens % 32) << 3  # (bools: the checks passed them)


def build_kernels(interpreted: bool = False) -> SimpleNamespace:
    """The kernels, as ``FastLaunch`` wrappers (or the plain ``triton.jit`` functions, for the
    interpreter). Raises ImportError without Triton."""
    from warmlink.ep.low_latency import _triton, _triton_combine, _triton_dispatch

    jits = {"dispatch": _triton_dispatch.dispatch, "combine": _triton_combine.combine, "mask_kernel": _triton.mask_kernel}
    return SimpleNamespace(**(jits if interpreted else {k: FastLaunch(v) for k, v in jits.items()}))


@functools.cache
def _gpu_kernels() -> SimpleNamespace:
    return build_kernels()


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


class DevicePath:
    """Row moves of one rank through kernels (See Note [Low-latency device path]).

    Args:
        layout: the group's low-latency layout.
        rank: this rank.
        bases: every rank's region address as mapped here (this rank's own too), by rank.
        device: a torch device for the state and scratch (a CUDA device; the CPU under Triton's
            interpreter in tests).
        timeout_s: every wait's deadline.
        outputs: the rank's outputs, where the receives write (their storage is fixed per parity).
        kernels: ``build_kernels()``'s (default: the compiled ones).
        shrink: a wait past its deadline masks the late rank (``mask``) and the call goes on
            without it, instead of failing (DeepEP's ``enable_shrink``).
    """

    def __init__(self, layout: LowLatencyLayout, rank: int, bases: dict[int, int], device: torch.device,
                 timeout_s: float, outputs: Outputs, kernels: SimpleNamespace | None = None,
                 shrink: bool = False) -> None:
        self.layout, self.rank, self.device, self.shrink = layout, rank, device, shrink
        self._index = device.index  # (looked up by every launch)
        # what host.cpp's acceptance of a call's tensors is told of them: device (-1: CPU), L, H, R
        self._accept = (device.index if device.type == "cuda" else -1, layout.local_experts, layout.hidden,
                        layout.num_ranks)
        self.timeout_ns = int(timeout_s * 1e9)
        self.kernels = kernels or _gpu_kernels()
        lay = layout
        self.bases = torch.tensor([bases[r] for r in range(lay.num_ranks)], dtype=torch.int64, device=device)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=device)
        self.mask = torch.zeros(lay.num_ranks, dtype=torch.int32, device=device)  # 1: a masked rank
        # per parity, as every word a send writes (two calls may run on two streams at once); the
        # send counts its rows per expert in them and its last program zeroes them again
        self.counts = list(torch.zeros(2, lay.num_experts, dtype=torch.int32, device=device))
        # read by the next call on the host, written by any kernel that fails (mapped: UVA)
        self.fail = torch.zeros(4, dtype=torch.int64, device="cpu", pin_memory=device.type == "cuda")
        self._fail_words = self.fail.numpy()  # read on every call
        self._fixed = [self._fixed_args(p, outputs) for p in range(2)]  # by parity: (dispatch's, combine's)
        # a launch of both phases waits in its receive for what its own programs send: all of them
        # must be resident at once, so it has at most one program per SM
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        # the constexprs, in the kernels' order (FastLaunch passes them so)
        ranks, h_block = _pow2(lay.num_ranks, 2), _pow2(lay.hidden, 128)
        self._dispatch_consts = {fp8: {"NUM_RANKS": lay.num_ranks, "R_BLOCK": ranks, "LOCAL": lay.local_experts,
                                       "L_BLOCK": _pow2(lay.local_experts, 2), "HIDDEN": lay.hidden, "H_BLOCK": h_block,
                                       "W_BLOCK": _pow2(lay.hidden // 8 if fp8 else lay.hidden // 4, 16),
                                       "S_BLOCK": _pow2(lay.num_scales, 4), "NUM_TOPK": lay.num_topk,
                                       "K_BLOCK": _pow2(lay.num_topk, 2), "BLOCK": _SCAN_BLOCK}
                                 for fp8 in (False, True)}
        # the combine's sum: eight BF16 values (16 bytes) of each row per thread a step
        self._combine_consts = {(phase, waits): {
            "PHASE": phase, "NUM_RANKS": lay.num_ranks, "R_BLOCK": ranks, "LOCAL": lay.local_experts,
            "HIDDEN": lay.hidden, "C_BLOCK": min(h_block, 8 * 32 * _WARPS["combine", phase]),
            "W_BLOCK": _pow2(lay.hidden // 4, 16), "NUM_TOPK": lay.num_topk,
            "K_BLOCK": _pow2(lay.num_topk, 2), "HAS_WAIT": waits, "SHRINK": shrink,
            "ROWS": _rows_a_step(_pow2(lay.hidden // 4, 16))}
            for phase in (SEND, RECV, BOTH) for waits in (False, True)}
        self._consts: dict[tuple, dict] = {}  # the dispatch's, by kind of call
        self._items = lay.local_experts * lay.num_ranks  # (local expert, rank) pairs
        # each kernel's phase's grid by the call's token count, looked up by every call (``_grid``: the rule)
        tokens = range(lay.max_tokens + 1)
        self._grids = {}
        for ph in (SEND, RECV, BOTH):
            self._grids["dispatch", ph] = [self._grid(ph, n, self._items) for n in tokens]
            self._grids["combine", ph] = [self._grid(ph, self._items, n) for n in tokens]
        # by kind of call, parity and topk_idx's dtype: its PackedLaunch, or False where it has none
        self._prepared: dict[tuple, object] = {}
        self._receives: dict[tuple, object] = {}  # a send's kind: its receive's PackedLaunch, once there is one

    def _fixed_args(self, p: int, outputs: Outputs) -> tuple[tuple, tuple]:
        """The kernels' arguments that every call of parity ``p`` passes alike (after the call's own):
        the dispatch's, the combine's. Parameters rather than words in device memory, so that a
        program's first load is its state word, not the address of it; they cost an eager call
        nothing, as a packed launch packs them once and reads only the call's own arguments."""
        lay = self.layout
        views = outputs.views(p, lay.max_tokens, True, False)
        packed = outputs.views(p, lay.max_tokens, True, True).scales
        own = int(self.bases[self.rank])
        # the words area of each parity (ep.low_latency._layout): combine signals, then acks
        words = lay.offset(f"words.{p}")
        combine_signal, combine_ack, dispatch_ack = (words + 8 * at for at in (0, lay.num_ranks, 2 * lay.num_ranks))
        shared = (self.bases, self.state, self.mask)
        dispatch = (*shared, self.counts[p], views.dispatched.data_ptr(), views.x.data_ptr(), views.scales.data_ptr(),
                    packed.data_ptr(), views.count.data_ptr(), views.src_info.data_ptr(),
                    views.layout_range.data_ptr(), views.comb_slot.data_ptr(), self.fail.data_ptr(), own, self.rank,
                    lay.offset(f"disp.{p}"), lay.offset(f"disp_meta.{p}"), lay.offset(f"signal.{p}"), dispatch_ack,
                    self.timeout_ns, lay.num_experts, p)
        combine = (*shared, self.fail.data_ptr(), own, self.rank, lay.offset(f"comb.{p}"), combine_signal, combine_ack,
                   self.timeout_ns, 2 + p)
        return dispatch, combine

    def _grid(self, phase: int, sends: int, receives: int) -> int:
        if phase == BOTH:
            return max(1, min(self._sms, max(sends, receives)))
        return max(1, sends if phase == SEND else receives)

    # -- dispatch ---------------------------------------------------------------------------------
    def dispatch(self, phase: int, p: int, x: torch.Tensor, topk_idx: torch.Tensor, tokens: int, fp8: bool,
                 round_scale: bool, ue8m0: bool, tag: int, cumulative_stats: torch.Tensor | None,
                 wait_stats: torch.Tensor | None):
        """Launch the dispatch's ``phase`` (SEND, RECV or BOTH) of parity ``p``; the send fills
        the parity's ``dispatched``'s top-left ``[N, K]`` with the handle's mask of the entries sent
        (``topk_idx >= 0``), the receive the rest of its outputs. Returns, for a send, the receive's
        launch packed (for ``receive``), or None."""
        n, num_cols = topk_idx.shape
        # any tensor of the dtype stands in for an absent one: the constexprs say it is not read
        cum, waits = cumulative_stats is not None, wait_stats is not None
        # the call's own arguments: a packed launch reads those alone and keeps the parity's
        args = (x, topk_idx, cumulative_stats if cum else self.mask, wait_stats if waits else self.state, n, num_cols,
                tokens, tag)
        kind = ("dispatch", phase, fp8, round_scale, ue8m0, cum, waits, p, topk_idx.dtype)
        grid = self._grids["dispatch", phase][n]
        prepared = self._prepared.get(kind)
        if prepared:
            then = self._receives.get(kind) if phase == SEND else None
            then_grid = self._grids["dispatch", RECV][n] if then else 0
            if prepared(grid, current_stream(self._index), args, then, then_grid):
                return then
        key = kind[1:7]
        consts = self._consts.get(key)
        if consts is None:  # made once per kind of call
            consts = self._consts[key] = {
                "PHASE": phase, **self._dispatch_consts[fp8], "FP8": fp8, "ROUND_SCALE": round_scale, "UE8M0": ue8m0,
                "HAS_CUM": cum, "HAS_WAIT": waits, "SHRINK": self.shrink,
                "ROWS": _rows_a_step(self._dispatch_consts[fp8]["W_BLOCK"])}
        self._launch(self.kernels.dispatch, kind, (grid,), args + self._fixed[p][0], consts, _WARPS["dispatch", phase],
                     _DISPATCH_VARYING[cum, waits], prepared)
        return None

    def dispatch_made(self, phase: int, p: int, x, topk_idx, tokens: int, fp8: bool, round_scale: bool, ue8m0: bool,
                      tag: int, cumulative_stats, wait_stats):
        """``dispatch`` of a call whose flags and ints ``LowLatencyChecks`` took, in one compiled
        call (``host.cpp``'s ``ll_dispatch_launch``) with the tensors' acceptance
        (``accepts_dispatch``'s): ``(what dispatch returns,)``; None, launching nothing, where the
        tensors are not taken as they are or the kind of call has no packed launch yet (as
        ``combine_made``)."""
        cum, waits = cumulative_stats is not None, wait_stats is not None
        kind = ("dispatch", phase, fp8, round_scale, ue8m0, cum, waits, p, getattr(topk_idx, "dtype", None))
        prepared = self._prepared.get(kind)
        plan = prepared.plan() if prepared else 0
        if not plan or topk_idx.dim() != 2 or topk_idx.shape[0] > tokens:  # (the grid's lookup needs its rows)
            return None
        n, num_cols = topk_idx.shape
        then = self._receives.get(kind) if phase == SEND else None
        args = (x, topk_idx, cumulative_stats if cum else self.mask, wait_stats if waits else self.state, n, num_cols,
                tokens, tag)  # (dispatch's own)
        device, local, hidden, ranks = self._accept
        if not prepared.compiled.ll_dispatch_launch(
                plan, self._grids["dispatch", phase][n], current_stream(self._index), args, then.plan() if then else 0,
                self._grids["dispatch", RECV][n] if then else 0, x, topk_idx, cumulative_stats, wait_stats, device,
                hidden, tokens, self.layout.num_topk, local, ranks):
            return None
        return (then,)

    # -- combine ----------------------------------------------------------------------------------
    def combine(self, phase: int, p: int, x: torch.Tensor, handle, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor, tag: int, wait_stats: torch.Tensor | None):
        """Launch the combine's ``phase`` of parity ``p``: ``x``'s rows (the dispatch's layout,
        ``handle``'s ranges) back to their sources, then ``out``, each token's weighted sum (the
        dispatch's mask ``handle.dispatched``, a ``[N, K]`` view of ``[T, num_topk]``, gives the
        kernel its strides). Returns what ``dispatch`` does."""
        n, num_cols = handle.num_tokens, handle.num_topk  # (topk_idx's shape: the checks held them equal)
        waits = wait_stats is not None
        args = (x, handle.layout_range, handle.comb_slot, topk_idx, topk_weights, handle.dispatched, out,
                wait_stats if waits else self.state, self.layout.num_ranks * handle.num_max_dispatch_tokens_per_rank, n,
                num_cols, tag)
        kind = ("combine", phase, waits, p, topk_idx.dtype)
        grid = self._grids["combine", phase][n]
        prepared = self._prepared.get(kind)
        if prepared:
            then = self._receives.get(kind) if phase == SEND else None
            then_grid = self._grids["combine", RECV][n] if then else 0
            if prepared(grid, current_stream(self._index), args, then, then_grid):
                return then
        self._launch(self.kernels.combine, kind, (grid,), args + self._fixed[p][1], self._combine_consts[phase, waits],
                     _WARPS["combine", phase], _COMBINE_VARYING[waits], prepared)
        return None

    def combine_made(self, phase: int, p: int, x, handle, topk_idx, topk_weights, out, tag: int, wait_stats):
        """``combine`` of a call whose flags ``LowLatencyChecks`` took, in one compiled call
        (``host.cpp``'s ``ll_combine_launch``) with the tensors' acceptance (``accepts_combine``'s)
        and the output (``out``, or a new BF16 ``[N, H]``): ``(output, what combine returns)``;
        None, launching nothing, where the tensors are not taken as they are or the kind of call
        has no packed launch yet (the caller then checks them by name and calls ``combine``)."""
        waits = wait_stats is not None
        kind = ("combine", phase, waits, p, getattr(topk_idx, "dtype", None))
        prepared = self._prepared.get(kind)
        plan = prepared.plan() if prepared else 0
        if not plan:
            return None
        then = self._receives.get(kind) if phase == SEND else None
        device, local, hidden, ranks = self._accept
        n, num_cols, rows = handle.num_tokens, handle.num_topk, ranks * handle.num_max_dispatch_tokens_per_rank
        args = (x, handle.layout_range, handle.comb_slot, topk_idx, topk_weights, handle.dispatched, out,
                wait_stats if waits else self.state, rows, n, num_cols, tag)  # (combine's, the output at 6)
        made = prepared.compiled.ll_combine_launch(
            plan, self._grids["combine", phase][n], current_stream(self._index), args, then.plan() if then else 0,
            self._grids["combine", RECV][n] if then else 0, 6, x, topk_idx, topk_weights, out, wait_stats, device,
            local, rows, hidden, n, num_cols, ranks)
        return None if made is None else (made, then)

    def receive(self, phase: str, packed, args: tuple) -> None:
        """A hook's receive of ``phase`` ("dispatch" or "combine"): the launch its send packed
        (``packed``, what the send returned), else launched as the send's ``args`` say."""
        if packed is None or not packed.launch_pending(current_stream(self._index)):
            (self.dispatch if phase == "dispatch" else self.combine)(RECV, *args)

    def _launch(self, kernel, kind: tuple, grid: tuple[int], args: tuple, consts: dict, num_warps: int,
                varying: frozenset[str], prepared) -> None:
        """A launch of ``kind`` that its ``PackedLaunch`` (ep.kernels.launch; ``prepared``, the
        caller's lookup: made after the kind's first launch) did not make: through ``launch``.
        The callers try the packed one first, themselves: an eager call's host time is its
        latency."""
        launch(kernel, grid, args, consts, num_warps=num_warps)
        if prepared is None and isinstance(kernel, FastLaunch):
            made = self._prepared[kind] = kernel.prepare(args, consts, num_warps, varying) or False
            if made and kind[1] == RECV:  # (kind[1]: the phase, as both kinds put it)
                self._receives[(kind[0], SEND, *kind[2:])] = made

    # -- the mask buffer (DeepEP's calls, on the current stream) ----------------------------------
    def query_mask(self, out: torch.Tensor) -> None:
        """Copy the mask (1: masked) into ``out``, int32 ``[R]`` on this device."""
        self._mask_op(0, out, 0, 0)

    def update_mask(self, rank: int, masked: bool) -> None:
        if masked and not self.shrink:  # the kernels read the mask only with shrink (SHRINK)
            raise ConfigError(f"ep low-latency: rank {rank} cannot be masked on a device path built without shrink")
        self._mask_op(1, self.mask, rank, int(masked))

    def clean_mask(self) -> None:
        self._mask_op(2, self.mask, 0, 0)

    def _mask_op(self, op: int, out: torch.Tensor, rank: int, value: int) -> None:
        lay = self.layout
        launch(self.kernels.mask_kernel, (1,), (self.mask, out, rank, value),
               {"NUM_RANKS": lay.num_ranks, "R_BLOCK": _pow2(lay.num_ranks, 2), "OP": op})

    # -- failures and lifecycle -------------------------------------------------------------------
    def failed(self) -> bool:
        """Whether a kernel reported a failure (``failure`` says which); read on every call."""
        return bool(self._fail_words[0])

    def failure(self) -> tuple[int, str, int, int] | None:
        """``(code, phase, seq, rank)`` a kernel reported, or None (``_failures.read``). Reads pinned
        memory: no synchronisation."""
        return _failures.read(self._fail_words)

    def close(self) -> None:
        self.bases = self.state = None
