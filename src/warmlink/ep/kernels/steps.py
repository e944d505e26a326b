"""The dispatch's device steps, each one launch: the send plan, the gathers, the unpack.

Over 400 lines: every step's launch sits beside its torch twin (the host path where there is no
Triton, and the reference the tests hold each kernel to), for every step of the dispatch's device path.

A fresh dispatch used to spend ~0.6 ms of host time in about twenty small torch launches (5-15 us
each) before its first copy; the GPU work behind them is ~0.1 ms. Each step here is one Triton
kernel on CUDA, and the same function in torch ops elsewhere (the shm backend, or no Triton), with
the same outputs: tests run both on the CPU, the kernels through Triton's interpreter.

- ``plan``: from ``is_token_in_rank``, every token's row in every destination's slot (the
  handle's ``combine_rows``, Note [Send order] in ep.kernels.layout), plus one int64 word vector for the
  host: the counts per destination recounted from the mask, the caller's counts per rank and per
  expert, and the smallest and largest expert id of each part. The dispatch reads it with one copy.
- ``gather``: every token's row, and its meta row (ids, weights, FP8 scales; ep.wire.regions), into
  the rows ``plan`` gave it, for a range of destinations: the staging slots of the peers before
  the copy engines push them, or this rank's own receive area.
- ``unpack``: meta rows to local expert ids (-1 elsewhere), weights and scales.
- ``exchange`` and ``push``: a fresh dispatch's send without the host (Note [SM sends] in
  ep.paths.sm_pushes).

# Note [Scales in place]
FP8 scales come as float32 ``[T, S]`` (``S = ceil(hidden / 128)``) with any strides: DeepEP's own
tests pass them column-major (``s.T.contiguous().T``, strides ``(1, T)``), the layout DeepGEMM
reads. A ``.contiguous()`` on those is a transposing copy kernel on every FP8 call on a GPU, so no
step copies them: scale ``j`` of token ``t`` is read at ``t * token stride + j * column stride``
(float32 elements) of the caller's own tensor. The torch versions index it as it is; ``gather``
and ``push`` take both strides as arguments (Triton specializes a stride of 1, so row-major scales
keep their contiguous loads there, and the first call of the other layout compiles its own
variant); the call-block forms read them from the block's ``scales_token_stride`` and
``scales_col_stride`` words, beside its address, not from ``FreshShape`` or the cached push's key:
a column-major column stride is T, which changes with the token count, so a key would capture a
graph per count, while from the block one graph serves either layout and never replays strides
captured for another call. The scales land in the meta row as before (ep.wire.regions): a receiver
never sees how the sender's were laid out.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from warmlink.ep.kernels import layout_cuda
from warmlink.ep.kernels.call_block import CALL_SLOTS, FreshShape, Padded, Sources, call_words
from warmlink.ep.kernels.launch import FastLaunch, launch

__all__ = ["CALL_SLOTS", "RANGE_PARTS", "FreshShape", "Kernels", "Padded", "Sources", "call_words", "exchange", "fresh_front",
           "fresh_push", "gather", "landing_size", "layout", "plan", "push", "push_from_call", "take_call", "unpack",
           "words_layout", "words_size"]

_BIG = 1 << 62
_TOKEN_BLOCK = 1024
_X_BLOCK = 512  # int64 words of a row per program: 4 KiB
_UNPACK_ROWS = 32
_PUSH_BLOCK = 1024  # int64 words of a row per step of a push program: 8 KiB
# Programs that scan the expert ids for their range, each over one part: one program over all 32K
# ids of the bench took 30 us, the longest part of the plan; the host takes the min of the parts.
RANGE_PARTS = 8


def words_layout(num_ranks: int, num_experts: int) -> dict[str, slice]:
    """Where each part lies in ``plan``'s word vector."""
    r, e, p = num_ranks, num_experts, RANGE_PARTS
    return {"sent": slice(0, r), "per_rank": slice(r, 2 * r), "per_expert": slice(2 * r, 2 * r + e),
            "lo": slice(2 * r + e, 2 * r + e + p), "hi": slice(2 * r + e + p, 2 * r + e + 2 * p)}


def words_size(num_ranks: int, num_experts: int) -> int:
    return 2 * num_ranks + num_experts + 2 * RANGE_PARTS


# -- torch versions (the reference, and the host path) ------------------------------------------
def _plan_torch(in_rank, topk, per_rank, per_expert, max_tokens):
    num_tokens, num_ranks = in_rank.shape
    dev = in_rank.device
    by_rank = in_rank.t().contiguous()
    pos = torch.cumsum(by_rank, 1, dtype=torch.int64)  # inclusive: pos[t] + 1
    base = (torch.arange(num_ranks, device=dev, dtype=torch.int64) * max_tokens - 1).view(-1, 1)
    rows = torch.where(by_rank, pos + base, -1).t().contiguous()
    flat, lo, hi = topk.reshape(-1).to(torch.int64), [], []
    part = -(-flat.numel() // RANGE_PARTS)
    for j in range(RANGE_PARTS):  # the kernel's parts, so that both give the same words
        ids = flat[j * part:(j + 1) * part]
        lo.append(int(ids.min()) if ids.numel() else _BIG)
        hi.append(int(ids.max()) if ids.numel() else -_BIG)
    parts = (by_rank.sum(1), per_rank.reshape(-1), per_expert.reshape(-1), torch.tensor(lo + hi, device=dev))
    return rows, torch.cat([p.to(torch.int64) for p in parts])


def _meta_views(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 and float32 views of ``[N, meta_bytes]`` uint8 meta rows."""
    return meta.view(torch.int64), meta.view(torch.float32)


def _gather_torch(rows, src: Sources, x_out, meta_out, meta_k, shift, dests, skip):
    ids, floats = _meta_views(meta_out) if meta_out is not None else (None, None)
    for d in (d for d in dests if d != skip):
        r = rows[:, d]
        tokens = torch.nonzero(r >= 0).view(-1)
        at = r.index_select(0, tokens) + shift
        x_out.index_copy_(0, at, src.x.index_select(0, tokens))
        if src.topk is not None:
            k = src.topk.shape[1]
            ids[at, :k] = src.topk.index_select(0, tokens).to(torch.int64)
            if src.weights is not None:
                floats[at, 2 * meta_k:2 * meta_k + k] = src.weights.index_select(0, tokens).float()
        if src.scales is not None:
            s = src.scales.shape[1]
            floats[at, 3 * meta_k:3 * meta_k + s] = src.scales.index_select(0, tokens)


def _unpack_torch(meta, meta_k, idx, w, scales, base, experts_per_rank, padded=None):
    if padded is not None:  # the rows received (the kernel's, from the board), then the padding rows
        total = padded.received(meta.shape[0])
        for t, fill in ((idx, -1), (w, 0)):
            if t is not None:
                t[total:].fill_(fill)
        meta, idx, w, scales = (t[:total] if t is not None else None for t in (meta, idx, w, scales))
    ids, floats = _meta_views(meta)
    if idx is not None:
        raw = ids[:, :idx.shape[1]]
        local = raw - base
        here = (raw >= 0) & (local >= 0) & (local < experts_per_rank)
        idx.copy_(torch.where(here, local, -1))
        if w is not None:
            w.copy_(torch.where(here, floats[:, 2 * meta_k:2 * meta_k + w.shape[1]], 0.0))
    if scales is not None:
        scales.copy_(floats[:, 3 * meta_k:3 * meta_k + scales.shape[1]])


# -- the kernels ------------------------------------------------------------------------------------
class Kernels(NamedTuple):
    """Triton and ep's kernels (ep.kernels.programs): plain ``triton.jit`` functions from ``_build`` (the
    interpreter's, in tests), ``FastLaunch`` wrappers from ``_kernels``."""

    triton: object
    plan: object
    gather: object
    unpack: object
    push: object
    plan_call: object
    exchange_call: object
    push_call: object
    layout: object
    take_call: object


@functools.cache
def _kernels() -> Kernels | None:
    try:
        triton, *jits = _build()
    except ImportError:
        return None
    return Kernels(triton, *(FastLaunch(j) for j in jits))


def _build() -> Kernels:
    """The kernels (ep.kernels.programs, imported here so that the package needs no Triton; tests build
    them for the interpreter)."""
    import triton

    from warmlink.ep.kernels import programs

    return Kernels(triton, programs.plan_kernel, programs.gather_kernel, programs.unpack_kernel, programs.push_kernel,
                   programs.plan_call_kernel, programs.exchange_call_kernel, programs.push_call_kernel, programs.layout_kernel,
                   programs.take_call_kernel)


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


# -- the entry points -------------------------------------------------------------------------------
_LAYOUT_TOKENS = 256  # tokens per program of ``layout``


def layout(topk: torch.Tensor, num_experts: int, num_ranks: int, kernels) -> tuple[torch.Tensor, ...]:
    """``ep.kernels.layout.dispatch_layout`` in one launch: ``(num_tokens_per_rank, num_tokens_per_expert,
    is_token_in_rank, num_bad_ids)``, the counts views of one int32 tensor. Its ~15 torch launches
    cost a DeepEP-style fresh dispatch ~0.25 ms of host time on an H200; the CUDA C++ block where it
    fits (ep.kernels.layout_cuda), else the Triton kernel (and a zeroing before it)."""
    topk = topk.contiguous()
    if layout_cuda.fits(topk, num_experts, num_ranks):  # one NVRTC launch, no zeroing (ep.kernels.layout_cuda)
        return layout_cuda.layout(topk, num_experts, num_ranks)
    num_tokens, num_k = topk.shape
    counts = torch.zeros(num_ranks + num_experts + 1, dtype=torch.int32, device=topk.device)
    in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=topk.device)
    if num_tokens and num_k:
        launch(kernels.layout, (_cdiv(num_tokens, _LAYOUT_TOKENS),),
               (topk, in_rank.view(torch.uint8), counts, num_tokens, num_k, num_experts, num_experts // num_ranks),
               {"NUM_RANKS": num_ranks, "T_BLOCK": _LAYOUT_TOKENS, "K_BLOCK": _pow2(num_k),
                "E_BINS": _pow2(num_experts + 1)})  # one bin past the experts: masked and bad ids
    else:
        in_rank.zero_()
    return (counts[:num_ranks], counts[num_ranks:num_ranks + num_experts], in_rank,
            counts[num_ranks + num_experts:])


def plan(in_rank: torch.Tensor, topk: torch.Tensor, per_rank: torch.Tensor, per_expert: torch.Tensor, max_tokens: int,
         kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [T, R] int64, words [words_size(R, E)] int64)``, both on the device, no host synchronization.

    ``rows[t, d]`` is ``d * max_tokens + pos[t, d]`` where token ``t`` goes to ``d`` (``pos``: its
    rank among the tokens that go there), else -1. ``words``: see ``words_layout``.
    """
    kernels = kernels or (_kernels() if in_rank.is_cuda else None)
    if kernels is None:
        return _plan_torch(in_rank, topk, per_rank, per_expert, max_tokens)
    in_rank, topk, per_rank, per_expert = (t.contiguous() for t in (in_rank, topk, per_rank, per_expert))
    num_tokens, num_ranks = in_rank.shape
    num_experts = per_expert.numel()
    rows = torch.empty(num_tokens, num_ranks, dtype=torch.int64, device=in_rank.device)
    words = torch.empty(words_size(num_ranks, num_experts), dtype=torch.int64, device=in_rank.device)
    launch(kernels.plan, (num_ranks + 1 + RANGE_PARTS,), (in_rank.view(torch.uint8), topk, per_rank, per_expert, rows,
                                                          words, num_tokens, topk.numel(), num_experts, max_tokens),
           {"NUM_RANKS": num_ranks, "BLOCK": _TOKEN_BLOCK, "BIG": _BIG, "PARTS": RANGE_PARTS})
    return rows, words


def gather(rows: torch.Tensor, src: Sources, x_out: torch.Tensor, meta_out: torch.Tensor | None, meta_k: int,
           dests: range, shift: int = 0, skip: int = -1, kernels=None) -> None:
    """``x_out[rows[t, d] + shift] = src.x[t]`` (and the meta row into ``meta_out``) for every token
    ``t`` that goes to a destination ``d`` in ``dests``.

    Args:
        rows: ``plan``'s rows. src: the tokens and their meta parts (scales with any strides).
        x_out: ``[N, W]`` int64 rows; meta_out: ``[N, meta_bytes]`` uint8 rows, or None when
            ``src`` has no meta part. meta_k: the buffer's ``num_topk`` (meta column offsets).
        dests: a contiguous range of destinations; skip: one of them to leave out (-1: none).
        shift: added to every row.
    """
    kernels = kernels or (_kernels() if rows.is_cuda else None)
    if kernels is None:
        _gather_torch(rows, src, x_out, meta_out, meta_k, shift, dests, skip)
        return
    num_tokens, num_ranks = rows.shape
    if not num_tokens or not len(dests):
        return
    src = _contiguous_but_scales(src)
    x_words = src.x.shape[1]
    ids, floats = _meta_views(meta_out) if meta_out is not None else (x_out, x_out)
    num_k = src.topk.shape[1] if src.topk is not None else 0
    num_scales = src.scales.shape[1] if src.scales is not None else 0
    meta_words = meta_out.shape[1] // 8 if meta_out is not None else 0
    grid = (num_tokens, _cdiv(x_words, _X_BLOCK))
    args = (rows, src.x, x_out, x_words, src.topk if src.topk is not None else rows,
            src.weights if src.weights is not None else rows, src.scales if src.scales is not None else rows,
            ids, floats, num_k, num_scales, *src.scale_strides, meta_words, meta_k, shift, dests.start, dests.stop, skip)
    launch(kernels.gather, grid, args, {
        "NUM_RANKS": num_ranks, "X_BLOCK": _X_BLOCK, "K_BLOCK": _pow2(num_k), "S_BLOCK": _pow2(num_scales),
        "HAS_TOPK": src.topk is not None, "HAS_W": src.weights is not None, "HAS_S": src.scales is not None})


def unpack(meta: torch.Tensor, meta_k: int, idx: torch.Tensor | None, w: torch.Tensor | None,
           scales: torch.Tensor | None, base: int, experts_per_rank: int, kernels=None, padded: Padded | None = None) -> None:
    """Fill ``idx`` (local expert ids, -1 for experts elsewhere or masked), ``w`` (0 where ``idx``
    is -1) and ``scales`` from ``[N, meta_bytes]`` uint8 meta rows. ``w`` needs ``idx``. With
    ``padded``, only the rows received are (its board says how many, on the device), and the
    others get id -1 and weight 0."""
    kernels = kernels or (_kernels() if meta.is_cuda else None)
    if kernels is None:
        _unpack_torch(meta, meta_k, idx, w, scales, base, experts_per_rank, padded)
        return
    total = meta.shape[0]
    if not total or (idx is None and scales is None):
        return
    ids, floats = _meta_views(meta)
    num_k = idx.shape[1] if idx is not None else 0
    num_scales = scales.shape[1] if scales is not None else 0
    board = padded.board if padded is not None else ids
    args = (ids, floats, idx if idx is not None else ids, w if w is not None else floats,
            scales if scales is not None else floats, total, num_k, num_scales, meta.shape[1] // 8, meta_k, base,
            experts_per_rank, board, *((padded.round, padded.rank, *board.shape) if padded else (0, 0, 0, 0)))
    launch(kernels.unpack, (_cdiv(total, _UNPACK_ROWS),), args, {
        "ROWS": _UNPACK_ROWS, "K_BLOCK": _pow2(num_k), "S_BLOCK": _pow2(num_scales), "HAS_TOPK": idx is not None,
        "HAS_W": w is not None, "HAS_S": scales is not None, "PADDED": padded is not None,
        "R_BLOCK": _pow2(board.shape[0]) if padded else 1})


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def push(rows: torch.Tensor, src: Sources, x_bases: torch.Tensor, meta_bases: torch.Tensor, meta_k: int,
         meta_bytes: int, skip: int = -1, programs: int = 0, num_warps: int = 0, kernels=None) -> None:
    """SM stores: ``src.x[t]`` to byte address ``x_bases[d] + rows[t, d] * row_bytes`` (and its meta
    row to ``meta_bases[d]``, rows of ``meta_bytes``) for every ``d != skip`` with ``rows[t, d] >= 0``
    and a base that is not 0. Bases may point into peers' mapped regions (Note [SM sends]).

    Args:
        rows: ``plan``'s rows. src: the tokens and their meta parts (scales with any strides).
        x_bases, meta_bases: ``[R]`` int64 device tensors of byte addresses (0: skip that destination).
        meta_k: the buffer's ``num_topk``. programs: the persistent grid (default: one per SM).
        num_warps: warps per program (0: Triton's default).
    """
    kernels = kernels or _kernels()
    num_tokens, num_ranks = rows.shape
    if not num_tokens:
        return
    src = _contiguous_but_scales(src)
    x_words = src.x.shape[1]
    num_k = src.topk.shape[1] if src.topk is not None else 0
    num_scales = src.scales.shape[1] if src.scales is not None else 0
    args = (rows, src.x, x_bases, meta_bases, x_words, num_tokens, src.topk if src.topk is not None else rows,
            src.weights if src.weights is not None else rows, src.scales if src.scales is not None else rows,
            num_k, num_scales, *src.scale_strides, meta_bytes // 8, meta_k, skip)
    launch(kernels.push, (programs or _push_programs(rows),), args,
           _push_constexprs(num_ranks, x_words, num_k, num_scales, src.topk is not None, src.weights is not None),
           num_warps=num_warps)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _contiguous_but_scales(src: Sources) -> Sources:
    """``src`` with x, ids and weights contiguous (the kernels read them by row size); the scales
    as the caller gave them, read through their strides (Note [Scales in place])."""
    return Sources(*(t.contiguous() if t is not None else None for t in (src.x, src.topk, src.weights)), src.scales)


def _push_programs(on: torch.Tensor) -> int:
    """The persistent push's grid: one program per SM (4 in the interpreter)."""
    return _sm_count(on.device.index) if on.is_cuda else 4


def _push_constexprs(num_ranks: int, x_words: int, num_k: int, num_scales: int, has_topk: bool, has_w: bool) -> dict:
    """The constexprs shared by ``push`` and ``push_from_call``."""
    block = min(_PUSH_BLOCK, _pow2(x_words))
    return {"NUM_RANKS": num_ranks, "X_BLOCK": block, "CHUNKS": _cdiv(x_words, block), "K_BLOCK": _pow2(num_k),
            "S_BLOCK": _pow2(num_scales), "HAS_TOPK": has_topk, "HAS_W": has_w, "HAS_S": num_scales > 0}


def _tl(kernels: Kernels, dtype: torch.dtype):
    """Triton's dtype for a torch one (``torch.int64`` -> ``tl.int64``)."""
    return getattr(kernels.triton.language, str(dtype).removeprefix("torch."))


def landing_size(num_ranks: int, board_row: int, num_experts: int) -> int:
    """int64 words where a count exchange lands its round (``exchange``'s ``landing``): a landed
    word per source, the board ``[R, board_row]``, then the plan's words."""
    return num_ranks + num_ranks * board_row + words_size(num_ranks, num_experts)


def take_call(host_call: int, call: torch.Tensor, counters: torch.Tensor | None = None, kernels=None) -> None:
    """On the current stream: the call block from pinned host memory (byte address ``host_call``,
    read when the launch runs) into ``call`` (int64 on the device); with ``counters`` (the streamed
    path's, ep.kernels.stream_counts) the next seq and the exchange's round too, the round into
    ``call``. One program: the first step of a fresh send's graph, ahead of ``fresh_front``."""
    launch((kernels or _kernels()).take_call, (1,), (host_call, call, counters if counters is not None else call),
           {"ADVANCE": counters is not None})


def fresh_front(shape: FreshShape, call: torch.Tensor, words: torch.Tensor, tables: torch.Tensor, abort: int, me: int,
                timeout_s: float, board_row: int, landing: int, kernels=None) -> None:
    """A fresh SM dispatch's ``plan`` and ``exchange`` on the current stream (Note [SM sends], Note
    [Fresh send graph]); every per-call value comes from ``call`` (``CALL_SLOTS``, int64 on the
    device), so the same launches can be captured once and replayed.

    Args:
        words: int64 device vector of at least ``words_size(R, E)``: ``plan``'s words.
        tables: ``[5, R]`` int64 device tensor: rows 0-2 are inputs (every rank's board, receive x
            and receive meta area of this round's parity, as byte addresses in this process), rows
            3-4 the push's x and meta bases, which ``exchange`` writes (0 everywhere when any rank's
            input was refused, or the wait ended by ``abort``: the byte address of a host int64
            that the host sets to the round, or by the timeout, twice ``timeout_s`` + 1 s).
        board_row: int64 words of a board row.
        landing: byte address of ``landing_size`` int64 words where the exchange lands the round
            (pinned host memory, or device scratch for a launch no host waits for).
    """
    k = kernels or _kernels()
    r = shape.num_ranks
    launch(k.plan_call, (r + 1 + RANGE_PARTS,), (call, words, shape.num_k, shape.num_experts, shape.max_tokens), {
        "NUM_RANKS": r, "BLOCK": _TOKEN_BLOCK, "BIG": _BIG, "PARTS": RANGE_PARTS, "TOPK_T": _tl(k, shape.topk),
        "RANK_T": _tl(k, shape.per_rank), "EXPERT_T": _tl(k, shape.per_expert)})
    exchange(shape, call, words, tables, abort, me, 2 * timeout_s + 1, board_row, landing, k)


def exchange(shape: FreshShape, call: torch.Tensor, words: torch.Tensor, tables: torch.Tensor, abort: int, me: int,
             backstop_s: float, board_row: int, landing: int, kernels=None) -> None:
    """``fresh_front``'s count exchange alone (tests run it in the interpreter, with ep.kernels.programs's
    clock and fence swapped out): ``words`` already hold this rank's plan, ``call`` the round.
    ``backstop_s``: how long the kernel waits for the peers on its own clock."""
    r = shape.num_ranks
    launch((kernels or _kernels()).exchange_call, (r,), (call, words, tables, abort, landing, me, shape.num_experts,
                                                         shape.num_experts // r, shape.max_tokens, shape.x_words * 8,
                                                         shape.meta_bytes, int(backstop_s * 1e9)), {
        "NUM_RANKS": r, "R_BLOCK": _pow2(r), "ROW": board_row, "E_BLOCK": 256,
        "PARTS": RANGE_PARTS})


def fresh_push(shape: FreshShape, call: torch.Tensor, tables: torch.Tensor, kernels=None) -> None:
    """A fresh SM dispatch's ``push`` on the current stream, at the bases ``fresh_front``'s exchange
    wrote into ``tables`` rows 3-4; the rows and sources come from ``call``."""
    push_from_call(call, tables[3], tables[4], shape.x_words, shape.num_ranks, shape.num_k, shape.num_scales,
                   shape.meta_k, shape.meta_bytes, shape.topk, shape.weights, kernels)


def push_from_call(call: torch.Tensor, x_bases: torch.Tensor, meta_bases: torch.Tensor, x_words: int, num_ranks: int,
                   num_k: int, num_scales: int, meta_k: int, meta_bytes: int, topk: torch.dtype | None,
                   weights: torch.dtype | None, kernels=None) -> None:
    """``push`` with the rows, x, ids, weights, scales (address and strides) and token count read
    from ``call`` (``CALL_SLOTS``): the launch a graph replays (Note [Fresh send graph], Note [Scales
    in place]). ``topk`` / ``weights``: the dtypes of the ids and weights sent (None: not sent);
    ``num_scales`` 0: no FP8 scales."""
    k = kernels or _kernels()
    launch(k.push_call, (_push_programs(call),), (call, x_bases, meta_bases, x_words, num_k, num_scales, meta_bytes // 8,
                                                  meta_k), {
        **_push_constexprs(num_ranks, x_words, num_k, num_scales, topk is not None, weights is not None),
        "TOPK_T": _tl(k, topk or torch.int64), "W_T": _tl(k, weights or torch.float32)})
