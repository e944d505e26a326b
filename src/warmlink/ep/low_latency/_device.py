"""The device data path of low-latency mode: kernels store rows straight into the peers' IPC-mapped
regions and poll signal words, with no host synchronisation inside a call.

# Note [Low-latency device path]
A call launches its kernels on the caller's stream and returns: nothing waits on the host, so a
dispatch + hook + combine + hook can be captured in a CUDA graph and replayed
(ep.low_latency._triton holds the kernels):

- dispatch, send: ``slots_kernel`` gives each (token, column) its slot, its rank among this
  rank's rows to the same expert (from ``topk_idx`` alone: there is no count exchange), and flags
  an expert id out of range; ``dispatch_send_kernel`` casts each token (FP8 on request) and stores
  it into slot ``(e, this rank)`` of each of its experts' ranks (ep.low_latency._layout). Its last
  program to finish (a per-kernel counter in the device state, after a system fence in every
  program) writes the signal word of every (rank, local expert): ``seq << 32 | tag << 24 |
  count``, where ``seq`` is this parity's dispatch sequence number and ``tag`` the call's
  arguments (``call_tag``); a refused input sends the count ``0xFFFFFF`` instead of rows;
- dispatch, receive (the hook, or at once): ``dispatch_recv_kernel``, a program per (local
  expert, source), spins on the signal words with the Buffer's timeout as a ``%globaltimer``
  deadline, then packs the rows into the outputs, whose addresses are fixed per parity; its last
  program writes "received seq" into every source's ack word;
- combine: the same two steps, rows stored at ``t * K + k`` in their source, one signal word per
  expert rank, and the weighted sum in the receive kernel.

A parity's sequence numbers live in device memory (the state words) and only the kernels advance
them, so a graph replay is a new round. Before a send stores into a rank it waits for that
rank's ack of this parity's previous round (the same two-rounds-in-flight rule as the host path,
Note [Low-latency rounds]), so a rank running ahead never overwrites what a peer has not read.

Failures cannot raise inside a call. A kernel whose wait times out marks the device state failed
(every later kernel then does nothing) and writes a code, the round and the rank it waited for
into a pinned host word; an argument mismatch between ranks, a refused input or a combine that
unmasks an entry writes its code there too but keeps the group going. The next call reads that
word on the host and raises (``failure``): ``TransferTimeout`` or ``PeerLostError`` (after a
liveness check) for good, ``ConfigError`` once. Synchronising the stream before the next call
makes that call the one that raises.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from warmlink.ep.kernels.launch import FastLaunch, launch
from warmlink.ep.low_latency._layout import LowLatencyLayout
from warmlink.ep.low_latency._outputs import ParityViews
from warmlink.errors import ConfigError, PeerLostError, TransferTimeout

__all__ = ["DevicePath", "build_kernels", "call_tag"]

STATE_WORDS = 16  # seq of (dispatch, combine) x parity, failed, bad input by parity, done counters (_triton)
F_TIMEOUT, F_MISMATCH, F_REFUSED, F_UNMASKED = 1, 2, 3, 4
_SLOT_BLOCK = 256
_KERNELS = ("slots_kernel", "dispatch_send_kernel", "dispatch_recv_kernel", "combine_send_kernel", "combine_recv_kernel")


def call_tag(tokens: int, fp8: bool, round_scale: bool, ue8m0: bool) -> int:
    """The 8 bits of a dispatch's arguments its signal words carry: ranks whose ``use_fp8``,
    ``round_scale`` or ``use_ue8m0`` differ, or whose ``num_max_dispatch_tokens_per_rank`` differs
    by other than a multiple of 32, are told apart."""
    return int(fp8) | int(round_scale) << 1 | int(ue8m0) << 2 | (tokens % 32) << 3


def build_kernels(interpreted: bool = False) -> SimpleNamespace:
    """The kernels, as ``FastLaunch`` wrappers (or the plain ``triton.jit`` functions, for the
    interpreter). Raises ImportError without Triton."""
    from warmlink.ep.low_latency import _triton

    jits = {name: getattr(_triton, name) for name in _KERNELS}
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
        kernels: ``build_kernels()``'s (default: the compiled ones).
    """

    def __init__(self, layout: LowLatencyLayout, rank: int, bases: dict[int, int], device: torch.device,
                 timeout_s: float, kernels: SimpleNamespace | None = None) -> None:
        self.layout, self.rank, self.device = layout, rank, device
        self.timeout_ns = int(timeout_s * 1e9)
        self.kernels = kernels or _gpu_kernels()
        lay = layout
        self.bases = torch.tensor([bases[r] for r in range(lay.num_ranks)], dtype=torch.int64, device=device)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=device)
        # per parity, as every word a send writes: two calls may run on two streams at once
        self.slots = list(torch.empty(2, lay.max_tokens * lay.num_topk, dtype=torch.int32, device=device))
        self.counts = list(torch.empty(2, lay.num_experts, dtype=torch.int32, device=device))
        # read by the next call on the host, written by any kernel that fails (mapped: UVA)
        self.fail = torch.zeros(4, dtype=torch.int64, device="cpu", pin_memory=device.type == "cuda")
        self._fail_words, self._fail_ptr = self.fail.numpy(), self.fail.data_ptr()  # read on every call
        self._off = {name: {p: lay.offset(f"{name}.{p}") for p in range(2)} for name in ("disp", "disp_meta", "signal",
                                                                                          "comb")}
        # the parts of each parity's words area (ep.low_latency._layout): combine signals, then acks
        for part, at in (("comb_signal", 0), ("dispatch_ack", lay.num_ranks), ("combine_ack", 2 * lay.num_ranks)):
            self._off[part] = {p: lay.offset(f"words.{p}") + 8 * at for p in range(2)}
        self._r_block = _pow2(lay.num_ranks, 2)
        self._h_block = _pow2(lay.hidden, 128)

    # -- dispatch ---------------------------------------------------------------------------------
    def send_dispatch(self, p: int, x: torch.Tensor, topk_idx: torch.Tensor, tokens: int, fp8: bool, round_scale: bool,
                      tag: int, dispatched: torch.Tensor) -> None:
        """Launch the dispatch's send; ``dispatched`` (bool ``[T, num_topk]``) gets the handle's
        mask of the entries sent, ``topk_idx >= 0``, in its top-left ``[N, K]``."""
        lay, k = self.layout, self.kernels
        n, num_cols = topk_idx.shape
        slots, counts = self.slots[p], self.counts[p]  # views made once
        launch(k.slots_kernel, (lay.num_experts + 1,), (topk_idx, slots, counts, self.state, dispatched, n * num_cols,
                                                        num_cols, lay.num_experts, p),
               {"NUM_TOPK": lay.num_topk, "BLOCK": _SLOT_BLOCK})
        launch(k.dispatch_send_kernel, (max(n, 1),),
               (x, topk_idx, slots, counts, self.bases, self.state, self._fail_ptr, self.rank, n,
                num_cols, tokens, self._off["disp"][p], self._off["disp_meta"][p], self._off["signal"][p],
                self._off["dispatch_ack"][p], p, tag, self.timeout_ns),
               {"NUM_RANKS": lay.num_ranks, "R_BLOCK": self._r_block, "LOCAL": lay.local_experts,
                "L_BLOCK": _pow2(lay.local_experts, 2), "HIDDEN": lay.hidden, "H_BLOCK": self._h_block,
                "NUM_TOPK": lay.num_topk, "FP8": fp8, "ROUND_SCALE": round_scale}, num_warps=8)

    def receive_dispatch(self, p: int, tokens: int, fp8: bool, ue8m0: bool, out: ParityViews, tag: int,
                         cumulative_stats: torch.Tensor | None, wait_stats: torch.Tensor | None) -> None:
        lay = self.layout
        words = lay.hidden // 8 if fp8 else lay.hidden // 4
        scales = out.scales if out.scales is not None else out.count  # any tensor: FP8 alone reads it
        launch(self.kernels.dispatch_recv_kernel, (lay.local_experts, lay.num_ranks),
               (self.bases, out.x, scales, out.count, out.src_info, out.layout_range, out.comb_slot,
                cumulative_stats if cumulative_stats is not None else out.count,
                wait_stats if wait_stats is not None else self.state, self.state, self._fail_ptr, self.rank,
                tokens, self._off["disp"][p], self._off["disp_meta"][p], self._off["signal"][p],
                self._off["dispatch_ack"][p], p, tag, self.timeout_ns),
               {"NUM_RANKS": lay.num_ranks, "R_BLOCK": self._r_block, "LOCAL": lay.local_experts, "HIDDEN": lay.hidden,
                "W_BLOCK": _pow2(words, 16), "NUM_TOPK": lay.num_topk, "FP8": fp8, "UE8M0": ue8m0,
                "S_BLOCK": _pow2(lay.num_scales, 4), "HAS_CUM": cumulative_stats is not None,
                "HAS_WAIT": wait_stats is not None}, num_warps=4)

    # -- combine ----------------------------------------------------------------------------------
    def send_combine(self, p: int, x: torch.Tensor, handle, tag: int) -> None:
        lay = self.layout
        launch(self.kernels.combine_send_kernel, (lay.local_experts, lay.num_ranks),
               (x, handle.layout_range, handle.comb_slot, self.bases, self.state, self._fail_ptr, self.rank,
                lay.num_ranks * handle.num_max_dispatch_tokens_per_rank, self._off["comb"][p],
                self._off["comb_signal"][p], self._off["combine_ack"][p], 2 + p, tag, self.timeout_ns),
               {"NUM_RANKS": lay.num_ranks, "R_BLOCK": self._r_block, "HIDDEN": lay.hidden,
                "W_BLOCK": _pow2(lay.hidden // 4, 16)}, num_warps=4)

    def receive_combine(self, p: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor, dispatched: torch.Tensor,
                        out: torch.Tensor, tag: int, wait_stats: torch.Tensor | None) -> None:
        lay = self.layout
        n, num_cols = topk_idx.shape
        launch(self.kernels.combine_recv_kernel, (max(n, 1),),
               (self.bases, topk_idx, topk_weights, dispatched, out, wait_stats if wait_stats is not None else self.state,
                self.state, self._fail_ptr, self.rank, n, num_cols, self._off["comb"][p],
                self._off["comb_signal"][p], self._off["combine_ack"][p], 2 + p, tag, self.timeout_ns),
               {"NUM_RANKS": lay.num_ranks, "R_BLOCK": self._r_block, "HIDDEN": lay.hidden, "H_BLOCK": self._h_block,
                "NUM_TOPK": lay.num_topk, "HAS_WAIT": wait_stats is not None}, num_warps=8)

    # -- failures and lifecycle -------------------------------------------------------------------
    def failure(self) -> tuple[int, str, int, int] | None:
        """``(code, phase, seq, rank)`` a kernel reported, or None; a code other than
        ``F_TIMEOUT`` is cleared (it is raised once). Reads pinned memory: no synchronisation."""
        words = self._fail_words
        code = int(words[0])
        if not code:
            return None
        slot, seq, rank = (int(v) for v in words[1:])
        if code != F_TIMEOUT:
            words[0] = 0
        return code, "dispatch" if slot < 2 else "combine", seq, rank

    def failure_error(self, func: str, device: int, refs: dict) -> Exception | None:
        """The exception of ``failure()``, or None: ``TransferTimeout`` / ``PeerLostError`` (the rank
        waited for is dead: ``refs[rank].alive()``) for a timeout, else ``ConfigError``."""
        failure = self.failure()
        if failure is None:
            return None
        code, phase, seq, r = failure
        what = f"{func}: an earlier low-latency {phase} on cuda:{device} (sequence {seq} of its parity)"
        if code == F_TIMEOUT:
            ref = refs.get(r)
            if ref is not None and not ref.alive():
                return PeerLostError(f"{what} waited for rank {r} (pid {ref.pid}), which died")
            return TransferTimeout(f"{what} waited {self.timeout_ns / 1e9:.3g} s for rank {r}; a peer is stalled, or "
                                   "the ranks made different low-latency calls")
        if code == F_MISMATCH:
            return ConfigError(f"{what}: rank {r} called with other arguments (num_max_dispatch_tokens_per_rank, "
                               "use_fp8, round_scale, use_ue8m0) or combined another dispatch's handle; every rank must "
                               "make the same call; that call's outputs are not valid (the next call goes on)")
        if code == F_REFUSED:
            return ConfigError(f"{what}: rank {r}'s topk_idx held an expert id outside [-1, "
                               f"{self.layout.num_experts}); that round moved no rows and its outputs are not valid "
                               "(the next call goes on)")
        return ConfigError(f"{what}: topk_idx of the combine selected experts where the dispatch's topk_idx held -1 "
                           "(entries may only be masked to -1); those rows were not summed")

    def close(self) -> None:
        self.bases = self.state = None
