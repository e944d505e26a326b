"""The streamed dispatch and combine as CUDA C++ (``stream.cu`` beside this module), compiled at run
time by NVRTC for the GPU at hand (warmlink._nvrtc). ep.kernels.stream and ep.kernels.stream_combine
check a call's arguments and launch these kernels, or the Triton ones, as their Buffer chose once
(``WARMLINK_EP_STREAM_KERNEL``; ``choose``).

# Note [Warp groups]
Why: a Triton program is one lockstep block. Each step of the Triton streamed kernels loads a
tile, stores it into every destination, then publishes after a block-wide barrier, so the loads,
stores and waits of different peers never overlap, and a program moved 7-10 GB/s where DeepEP's
move about 20 (BENCHMARKS.md). Triton cannot give warps different work; CUDA C++ can.

Here a program's warps form a group per peer (``24 // R`` warps each, at most 15 groups: one named
barrier each, ``bar.sync 1 + g``). A sender's group g serves destination g alone: its leader (lane
0 of the group's first warp) polls g's head for credits and publishes g's tail; its warps copy one
row each, 16 bytes a lane, 8 loads in flight before the stores. A receiver's group g takes source
g's rows by the same rules. A slow peer holds up its own group, not the program. The combine's
receiver sums a token per warp (8 elements a lane a step, every rank's copy loaded before the sum,
summed in rank order: the same bits as the Triton kernel and the torch reference); lane 0 of warp
d waits for rank d's rows of the tile and gives rank d its credits back.

Everything on the wire is the Triton kernels' (Note [Streamed dispatch], Note [Streamed combine]):
the space's words, the rows, the seq rule, FIN, the deadlines and abort word, the status words and
``taken``, so ``failures`` and the host protocol read both alike. A group's failure stops that
group (it publishes no FIN, so its peer fails too) and the program's status word names the first
failed group's wait.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from importlib import resources

import torch

from warmlink.ep.kernels import host
from warmlink.ep.kernels.launch import current_stream

__all__ = ["COMBINE_PROGRAMS", "MAX_RANKS", "THREADS", "PreparedDispatch", "choose", "combine", "combine_merge",
           "dispatch", "pack_dispatch", "prepare_dispatch", "sum_ranks"]

log = logging.getLogger("warmlink.ep")

THREADS = 768  # 24 warps a program: a group of 24 // R per peer
MAX_RANKS = 8  # the combine's receiver holds every rank's copy of a token at once (stream.cu's MAX_RANKS)
_KERNELS = ("warmlink_stream_dispatch", "warmlink_stream_combine")
# a sender's tail every `publish` rows, a receiver's visit of at most `batch` rows (tools/stream_sweep.py
# sets them; batch 32 beat 16 by 5-12% in three sweeps on 2 x H200)
STEPS = {"publish": 16, "batch": 32}
OPTIONS: tuple[str, ...] = ()  # NVRTC options of every compile of this process (tools/stream_sweep.py: -DUNROLL=n)
# the kernels' argument structs (stream.cu's DispatchArgs and CombineArgs), packed field by field
_DISPATCH = struct.Struct(f"<18Q{15 + MAX_RANKS}q12iqQ")
# where PreparedDispatch.launch patches it: out_x..out_s (pointers 7-10), out_rows (word 10 after
# the 18 pointers), starts (words 13-20 after them)
_OUT_AT, _OUT_ROWS_AT, _STARTS_AT = 7 * 8, (18 + 10) * 8, (18 + 13) * 8
_OUTPUTS, _WORD, _STARTS = struct.Struct("<4Q"), struct.Struct("<q"), struct.Struct(f"<{MAX_RANKS}q")
_COMBINE = struct.Struct("<12Q7q8i")


@functools.cache
def _source() -> str:
    return resources.files("warmlink.ep.kernels").joinpath("stream.cu").read_text()


COMBINE_PROGRAMS = 10  # from 3 ranks on, the most programs a side of a combine (combine_merge)


def combine_merge(num_ranks: int, channels: int) -> int:
    """The dispatch channels one program of the combine takes (stream.cu's Merged channels): 1 at
    two ranks; from three on, enough for at most ``COMBINE_PROGRAMS`` a side, since on 4 x H200 a
    combine of 10 programs a side ran 10-25% faster than one of 20 (tools/stream_sweep.py, the
    dispatch on as many channels). The default shape from three ranks on has 10 channels
    (ep.api.options.stream_defaults), so only a Buffer built with more merges them."""
    return 1 if num_ranks <= 2 else -(-channels // COMBINE_PROGRAMS)


def sum_ranks(num_ranks: int) -> int:
    """The ranks the combine's sum is compiled for (stream.cu's SUM_RANKS: it keeps a lane's loads of
    2 ranks' copies 4 steps deep, of 4 ranks' 2, of up to 8 ranks' 1, in the same registers)."""
    return 2 if num_ranks <= 2 else 4 if num_ranks <= 4 else MAX_RANKS


@functools.cache
def _kernels(device: int, num_ranks: int) -> dict:
    from warmlink import _nvrtc

    return _nvrtc.load(_source(), "warmlink_stream", device, _KERNELS, (*OPTIONS, f"-DSUM_RANKS={sum_ranks(num_ranks)}"))


@functools.cache
def choose(device: int, num_ranks: int) -> str:
    """``"cuda"`` or ``"triton"``: the streamed kernels a Buffer on ``device`` with ``num_ranks``
    ranks launches. CUDA where ``WARMLINK_EP_STREAM_KERNEL`` allows it (the default), the group fits
    (at most ``MAX_RANKS``) and NVRTC compiles ``stream.cu`` here; otherwise Triton, and a warning
    says why when CUDA was asked for. Choosing CUDA builds ep.kernels.host too (where it can be
    built): a rank that built it inside its first call could spend its peers' deadline."""
    from warmlink import _env

    if _env.ep_stream_kernel() != "cuda":
        return "triton"
    if num_ranks > MAX_RANKS:
        log.warning("ep: %d ranks; the CUDA streamed kernels take at most %d: the Triton ones run", num_ranks,
                    MAX_RANKS)
        return "triton"
    from warmlink.errors import TransferError

    try:
        _kernels(device, num_ranks)
    except (ImportError, TransferError) as exc:  # no NVRTC, it refused the source, or the driver the cubin
        log.warning("ep: the CUDA streamed kernels are unavailable on cuda:%d (%s): the Triton ones run", device, exc)
        return "triton"
    host.module()  # their compiled host steps too: built now, at setup, not inside a call's deadline
    return "cuda"


def _launch(name: str, device: int, num_ranks: int, grid: int, packed: bytes) -> None:
    args = ctypes.create_string_buffer(packed, len(packed))
    _kernels(device, num_ranks)[name](grid, THREADS, args, current_stream(device))


def _ptr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


_WEIGHT_KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # stream.cu's w_kind


def weight_kind(weights: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """``(weights, w_kind)`` as the dispatch kernel reads them: float32, BF16 and FP16 as they are,
    any other float (the protocol takes any) converted to float32 first; ``(None, 0)`` without."""
    if weights is None:
        return None, 0
    if weights.dtype not in _WEIGHT_KINDS:
        weights = weights.float()
    return weights, _WEIGHT_KINDS[weights.dtype]


def dispatch(space, rows, x, topk, weights, scales, bases, recv_offset, out, status, abort: int, valid, me: int, seq,
             max_tokens: int, meta_words: int, experts_per_rank: int, timeout_ns: int, taken, publish: int = 16,
             batch: int = 16, advance=None, starts: list[int] | None = None, padded=None) -> None:
    """Launch the streamed dispatch (``stream_dispatch``'s arguments, checked there or by the
    protocol (ep.paths.streamed calls this directly); ``x`` as
    contiguous int64 words, ``seq`` and ``valid`` device words, ``taken`` a ``[R, C]`` tensor,
    ``status`` device or pinned host memory, ``advance`` None or a zeroed device word: the launch
    runs the call after ``seq``'s and stores it back; ``starts``: ``recv_offset``'s values, passed by
    value, which the launch writes into ``recv_offset``; ``padded``: ``(board copy, num_worst_tokens)``
    of a padded round, from which the launch takes whether the round stands, the offsets (written
    into ``recv_offset``) and the rows to pad, instead of ``padded_plan`` and two fills)."""
    prepare_dispatch(space, rows, x, topk, weights, scales, bases, recv_offset, status, abort, valid, me, seq,
                     max_tokens, meta_words, experts_per_rank, timeout_ns, taken, publish, batch, advance,
                     starts is not None, padded).launch(out, starts)


class PreparedDispatch:
    """A dispatch's launch packed but for its outputs and its offsets (``dispatch``'s arguments,
    less ``out`` and ``starts``): a fresh dispatch packs it while the GPUs trade the counts, and
    ``launch`` then patches what the counts decide (Note [Streamed calls] in ep.protocol.streamed).
    A planned fresh dispatch (ep.paths.planned) has its struct packed by compiled code, from the
    struct of its kind's first call (``args``)."""

    __slots__ = ("_args", "_kernel", "_stream", "_grid", "_starts_given")

    def __init__(self, args: ctypes.Array, device: int, grid: int, starts_given: bool, kernel) -> None:
        self._args, self._grid, self._starts_given, self._kernel = args, grid, starts_given, kernel
        self._stream = current_stream(device)  # (looked up now: the launch is on the way to the GPUs)

    @property
    def args(self) -> ctypes.Array:
        """The packed struct (stream.cu's DispatchArgs)."""
        return self._args

    @property
    def grid(self) -> int:
        return self._grid

    @property
    def kernel_address(self) -> int:
        return self._kernel.address

    def with_args(self, args: ctypes.Array, device: int) -> "PreparedDispatch":
        """The same launch over another struct (a planned call's, patched by compiled code)."""
        return PreparedDispatch(args, device, self._grid, self._starts_given, self._kernel)

    def on(self, stream: int) -> None:
        """Launch on ``stream`` (a planned call's current stream)."""
        self._stream = stream

    def launch(self, out, starts: list[int] | None = None) -> None:
        """Write ``out``'s addresses and rows (and ``starts``, as prepared for) in, and launch on the
        stream that was current when it was prepared."""
        if (starts is not None) != self._starts_given:
            raise ValueError(f"PreparedDispatch.launch: starts={starts!r}; prepared with starts_given={self._starts_given}")
        args = self._args
        _OUTPUTS.pack_into(args, _OUT_AT, out.x.data_ptr(), _ptr(out.idx), _ptr(out.weights), _ptr(out.scales))
        _WORD.pack_into(args, _OUT_ROWS_AT, out.x.shape[0])
        if starts is not None:
            _STARTS.pack_into(args, _STARTS_AT, *starts, *(0,) * (MAX_RANKS - len(starts)))
        self._kernel(self._grid, THREADS, args, self._stream)

    def launch_from_board(self, compiled, board_address: int, num_ranks: int, row_words: int, rank: int,
                          max_tokens: int, src) -> tuple | None:
        """``launch`` by the compiled host steps (ep.kernels.host, ``compiled``: its module), straight
        from the count board in pinned memory at ``board_address`` (``[num_ranks, row_words]``, as
        ``recv_starts`` reads it): outputs for ``src``'s rows sized from it (as ``stream.outputs``
        makes them), the starts patched in, launched. ``((x, idx, weights, scales), starts)``; None,
        with nothing allocated or launched, where the board has a late source or a count out of
        range (``recv_starts`` raises what is wrong)."""
        if not self._starts_given:
            raise ValueError("PreparedDispatch.launch_from_board: prepared with starts_given=False")
        return self.launch_planned(compiled, self.board_args(board_address, num_ranks, row_words, rank, max_tokens, src))

    def board_args(self, board_address: int, num_ranks: int, row_words: int, rank: int, max_tokens: int,
                   src) -> tuple:
        """``fresh_launch``'s arguments but the stream, for ``launch_planned``."""
        x = src.x
        return (board_address, num_ranks, row_words, rank, max_tokens, x.shape[1],
                src.topk.shape[1] if src.topk is not None else -1, src.weights is not None,
                src.scales.shape[1] if src.scales is not None else 0, x.device.index if x.is_cuda else -1,
                ctypes.addressof(self._args), _OUT_AT, _OUT_ROWS_AT, _STARTS_AT, MAX_RANKS, host.launch_address(),
                self._kernel.address, self._grid, THREADS)

    def launch_planned(self, compiled, board_args: tuple) -> tuple | None:
        """``launch_from_board`` with its arguments made before (``board_args``: for this struct)."""
        done = compiled.fresh_launch(*board_args, self._stream)
        if done[0] in (host.LATE, host.OUT_OF_RANGE):
            return None
        status, starts, *outputs, error = done
        if status == host.DRIVER_ERROR:
            self._kernel.failed(error, self._grid, THREADS)
        return outputs, starts


def prepare_dispatch(space, rows, x, topk, weights, scales, bases, recv_offset, status, abort: int, valid, me: int,
                     seq, max_tokens: int, meta_words: int, experts_per_rank: int, timeout_ns: int, taken,
                     publish: int = 16, batch: int = 16, advance=None, starts_given: bool = False,
                     padded=None) -> PreparedDispatch:
    """``dispatch``'s launch, packed without its outputs and offsets (``PreparedDispatch.launch``
    gives them); ``starts_given``: the launch will get ``starts``."""
    packed = pack_dispatch(space, rows, x, topk, weights, scales, bases, recv_offset, status, abort, valid, me, seq,
                           max_tokens, meta_words, experts_per_rank, timeout_ns, taken, publish, batch, advance,
                           starts_given, padded)
    device = x.device.index
    return PreparedDispatch(ctypes.create_string_buffer(packed, len(packed)), device, 2 * space.channels, starts_given,
                            _kernels(device, space.num_ranks)["warmlink_stream_dispatch"])


def pack_dispatch(space, rows, x, topk, weights, scales, bases, recv_offset, status, abort: int, valid, me: int, seq,
                  max_tokens: int, meta_words: int, experts_per_rank: int, timeout_ns: int, taken, publish: int = 16,
                  batch: int = 16, advance=None, starts_given: bool = False, padded=None, posted=None) -> bytes:
    """``prepare_dispatch``'s struct (stream.cu's DispatchArgs), its outputs and offsets zero;
    ``posted``: ``(tag, address)`` of a posted outputs block (Note [Posted outputs] in
    ep.paths.planned: compiled code patches them in)."""
    r, c = space.num_ranks, space.channels
    num_tokens, x_words = x.shape
    num_k = topk.shape[1] if topk is not None else 0
    num_scales = scales.shape[1] if scales is not None else 0
    s_token, s_col = scales.stride() if scales is not None else (0, 0)
    weights, w_kind = weight_kind(weights)
    return _DISPATCH.pack(
        rows.data_ptr(), x.data_ptr(), _ptr(topk), _ptr(weights), _ptr(scales), bases.data_ptr(),
        recv_offset.data_ptr(), 0, 0, 0, 0,
        status.data_ptr(), abort, valid.data_ptr(), seq.data_ptr(), _ptr(advance), taken.data_ptr(),
        padded[0].data_ptr() if padded is not None else 0,
        num_tokens, max_tokens, x_words, num_k, num_scales, s_token, s_col, meta_words, space.row_words,
        space.ring_rows, 0, experts_per_rank, timeout_ns, *(0,) * MAX_RANKS,
        padded[0].stride(0) if padded is not None else 0, padded[1] if padded is not None else 0,
        me, r, c, topk.element_size() if topk is not None else 0, w_kind, int(scales is not None), publish, batch,
        (THREADS // 32) // r, int(starts_given), int(padded is not None), 0, *(posted or (0, 0)))


def combine(space, rows, x_words_t, weights, taken, recv_offset, bases, out, out_weights, status, abort: int, me: int,
            seq, timeout_ns: int, publish: int = 16, batch: int = 16, advance=None) -> None:
    """Launch the streamed combine (``stream_combine``'s arguments, checked there; ``x_words_t`` the
    expert outputs as int64 words; ``status`` and ``advance`` as ``dispatch``'s)."""
    r, c = space.num_ranks, space.channels
    n, x_words = x_words_t.shape
    packed = _COMBINE.pack(
        rows.data_ptr(), x_words_t.data_ptr(), _ptr(weights), taken.data_ptr(), recv_offset.data_ptr(),
        bases.data_ptr(), out.data_ptr(), _ptr(out_weights), status.data_ptr(), abort, seq.data_ptr(), _ptr(advance),
        rows.shape[0], n, x_words, weights.shape[1] if weights is not None else 0, space.row_words, space.ring_rows,
        timeout_ns, me, r, c, int(out.dtype == torch.float16), publish, batch, (THREADS // 32) // r,
        combine_merge(r, c))
    _launch("warmlink_stream_combine", x_words_t.device.index, r, 2 * c, packed)
