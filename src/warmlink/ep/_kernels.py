"""The dispatch's device steps, each one launch: the send plan, the gathers, the unpack.

A fresh dispatch used to spend ~0.6 ms of host time in about twenty small torch launches (5-15 us
each) before its first copy; the GPU work behind them is ~0.1 ms. Each step here is one Triton
kernel on CUDA, and the same function in torch ops elsewhere (the shm backend, or no Triton), with
the same outputs: tests run both on the CPU, the kernels through Triton's interpreter.

- ``plan``: from ``is_token_in_rank``, every token's row in every destination's slot (the
  handle's ``combine_rows``, Note [Send order] in ep.layout), plus one int64 word vector for the
  host: the counts per destination recounted from the mask, the caller's counts per rank and per
  expert, and the smallest and largest expert id of each part. The dispatch reads it with one copy.
- ``gather``: every token's row, and its meta row (ids, weights, FP8 scales; ep._regions), into
  the rows ``plan`` gave it, for a range of destinations: the staging slots of the peers before
  the copy engines push them, or this rank's own receive area.
- ``unpack``: meta rows to local expert ids (-1 elsewhere), weights and scales.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from warmlink.ep._launch import FastLaunch, launch

__all__ = ["RANGE_PARTS", "Sources", "gather", "plan", "unpack", "words_layout", "words_size"]

_BIG = 1 << 62
_TOKEN_BLOCK = 1024
_X_BLOCK = 512  # int64 words of a row per program: 4 KiB
_UNPACK_ROWS = 32
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


@dataclass(frozen=True)
class Sources:
    """What a dispatch sends per token: ``x`` as int64 words ``[T, W]``, and the optional parts of
    its meta row: ``topk`` ``[T, k]`` ids, ``weights`` ``[T, k]`` float, ``scales`` ``[T, S]`` float32."""

    x: torch.Tensor
    topk: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    @property
    def has_meta(self) -> bool:
        return self.topk is not None or self.scales is not None


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


def _unpack_torch(meta, meta_k, idx, w, scales, base, experts_per_rank):
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
@functools.cache
def _kernels():
    try:
        triton, *jits = _build()
    except ImportError:
        return None
    return (triton, *(FastLaunch(j) for j in jits))


def _build():
    """Define the kernels (separate from ``_kernels`` so tests can build them for the interpreter)."""
    import triton
    import triton.language as tl

    @triton.jit
    def plan_kernel(in_rank_ptr, topk_ptr, per_rank_ptr, per_expert_ptr, rows_ptr, words_ptr,
                    num_tokens, num_entries, num_experts, max_tokens,
                    NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr, BIG: tl.constexpr, PARTS: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if pid < NUM_RANKS:  # one program scans one destination's column
            carry = tl.zeros([], dtype=tl.int64)
            for start in range(0, num_tokens, BLOCK):
                t = (start + offs).to(tl.int64)
                m = t < num_tokens
                flag = (tl.load(in_rank_ptr + t * NUM_RANKS + pid, mask=m, other=0) != 0).to(tl.int32)
                incl = tl.cumsum(flag, 0).to(tl.int64)
                row = pid * max_tokens + carry + incl - 1
                tl.store(rows_ptr + t * NUM_RANKS + pid, tl.where(flag != 0, row, -1), mask=m)
                carry += tl.sum(flag, 0).to(tl.int64)
            tl.store(words_ptr + pid, carry)
            tl.store(words_ptr + NUM_RANKS + pid, tl.load(per_rank_ptr + pid).to(tl.int64))
        elif pid == NUM_RANKS:  # the per-expert counts
            for start in range(0, num_experts, BLOCK):
                e = start + offs
                v = tl.load(per_expert_ptr + e, mask=e < num_experts, other=0).to(tl.int64)
                tl.store(words_ptr + 2 * NUM_RANKS + e, v, mask=e < num_experts)
        else:  # the range of the expert ids in one part
            j = pid - NUM_RANKS - 1
            part = tl.cdiv(num_entries, PARTS)
            end = tl.minimum(num_entries, (j + 1) * part)
            lo = tl.full([], BIG, dtype=tl.int64)
            hi = tl.full([], -BIG, dtype=tl.int64)
            for start in range(j * part, end, BLOCK):
                e = (start + offs).to(tl.int64)
                m = e < end
                v = tl.load(topk_ptr + e, mask=m, other=0).to(tl.int64)
                lo = tl.minimum(lo, tl.min(tl.where(m, v, BIG), 0))
                hi = tl.maximum(hi, tl.max(tl.where(m, v, -BIG), 0))
            tl.store(words_ptr + 2 * NUM_RANKS + num_experts + j, lo)
            tl.store(words_ptr + 2 * NUM_RANKS + num_experts + PARTS + j, hi)

    @triton.jit
    def gather_kernel(rows_ptr, x_ptr, x_out_ptr, x_words, topk_ptr, w_ptr, s_ptr, ids_out_ptr, floats_out_ptr,
                      num_k, num_scales, meta_words, meta_k, shift, d_lo, d_hi, skip,
                      NUM_RANKS: tl.constexpr, X_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                      HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * X_BLOCK + tl.arange(0, X_BLOCK)
        in_row = cols < x_words
        row = tl.load(x_ptr + t * x_words + cols, mask=in_row)
        kc = tl.arange(0, K_BLOCK)
        sc = tl.arange(0, S_BLOCK)
        if HAS_TOPK:
            ids = tl.load(topk_ptr + t * num_k + kc, mask=kc < num_k).to(tl.int64)
        if HAS_W:
            ws = tl.load(w_ptr + t * num_k + kc, mask=kc < num_k).to(tl.float32)
        if HAS_S:
            ss = tl.load(s_ptr + t * num_scales + sc, mask=sc < num_scales)
        for d in tl.static_range(NUM_RANKS):
            if (d >= d_lo) & (d < d_hi) & (d != skip):
                at = tl.load(rows_ptr + t * NUM_RANKS + d)
                if at >= 0:
                    at += shift
                    tl.store(x_out_ptr + at * x_words + cols, row, mask=in_row)
                    if chunk == 0:  # the first chunk's program also moves the meta row
                        if HAS_TOPK:
                            tl.store(ids_out_ptr + at * meta_words + kc, ids, mask=kc < num_k)
                        if HAS_W:
                            tl.store(floats_out_ptr + at * 2 * meta_words + 2 * meta_k + kc, ws, mask=kc < num_k)
                        if HAS_S:
                            tl.store(floats_out_ptr + at * 2 * meta_words + 3 * meta_k + sc, ss, mask=sc < num_scales)

    @triton.jit
    def unpack_kernel(ids_ptr, floats_ptr, idx_ptr, w_ptr, s_ptr, total, num_k, num_scales, meta_words, meta_k,
                      base, experts_per_rank, ROWS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                      HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr):
        r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        live = r < total
        if HAS_TOPK:
            k = tl.arange(0, K_BLOCK)[None, :]
            m = live & (k < num_k)
            raw = tl.load(ids_ptr + r * meta_words + k, mask=m, other=-1)
            local = raw - base
            here = (raw >= 0) & (local >= 0) & (local < experts_per_rank)
            tl.store(idx_ptr + r * num_k + k, tl.where(here, local, -1), mask=m)
            if HAS_W:
                w = tl.load(floats_ptr + r * 2 * meta_words + 2 * meta_k + k, mask=m, other=0.0)
                tl.store(w_ptr + r * num_k + k, tl.where(here, w, 0.0), mask=m)
        if HAS_S:
            s = tl.arange(0, S_BLOCK)[None, :]
            m = live & (s < num_scales)
            tl.store(s_ptr + r * num_scales + s, tl.load(floats_ptr + r * 2 * meta_words + 3 * meta_k + s, mask=m), mask=m)

    return triton, plan_kernel, gather_kernel, unpack_kernel


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


# -- the entry points -------------------------------------------------------------------------------
def plan(in_rank: torch.Tensor, topk: torch.Tensor, per_rank: torch.Tensor, per_expert: torch.Tensor, max_tokens: int,
         kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [T, R] int64, words [words_size(R, E)] int64)``, both on the device, no host synchronization.

    ``rows[t, d]`` is ``d * max_tokens + pos[t, d]`` where token ``t`` goes to ``d`` (``pos``: its
    rank among the tokens that go there), else -1. ``words``: see ``words_layout``.
    """
    kernels = kernels or (_kernels() if in_rank.is_cuda else None)
    if kernels is None:
        return _plan_torch(in_rank, topk, per_rank, per_expert, max_tokens)
    _, plan_kernel, _, _ = kernels
    in_rank, topk, per_rank, per_expert = (t.contiguous() for t in (in_rank, topk, per_rank, per_expert))
    num_tokens, num_ranks = in_rank.shape
    num_experts = per_expert.numel()
    rows = torch.empty(num_tokens, num_ranks, dtype=torch.int64, device=in_rank.device)
    words = torch.empty(words_size(num_ranks, num_experts), dtype=torch.int64, device=in_rank.device)
    launch(plan_kernel, (num_ranks + 1 + RANGE_PARTS,), (in_rank.view(torch.uint8), topk, per_rank, per_expert, rows, words, num_tokens,
                                           topk.numel(), num_experts, max_tokens),
           {"NUM_RANKS": num_ranks, "BLOCK": _TOKEN_BLOCK, "BIG": _BIG, "PARTS": RANGE_PARTS})
    return rows, words


def gather(rows: torch.Tensor, src: Sources, x_out: torch.Tensor, meta_out: torch.Tensor | None, meta_k: int,
           dests: range, shift: int = 0, skip: int = -1, kernels=None) -> None:
    """``x_out[rows[t, d] + shift] = src.x[t]`` (and the meta row into ``meta_out``) for every token
    ``t`` that goes to a destination ``d`` in ``dests``.

    Args:
        rows: ``plan``'s rows. src: the tokens and their meta parts.
        x_out: ``[N, W]`` int64 rows; meta_out: ``[N, meta_bytes]`` uint8 rows, or None when
            ``src`` has no meta part. meta_k: the buffer's ``num_topk`` (meta column offsets).
        dests: a contiguous range of destinations; skip: one of them to leave out (-1: none).
        shift: added to every row.
    """
    kernels = kernels or (_kernels() if rows.is_cuda else None)
    if kernels is None:
        _gather_torch(rows, src, x_out, meta_out, meta_k, shift, dests, skip)
        return
    triton, _, gather_kernel, _ = kernels
    num_tokens, num_ranks = rows.shape
    if not num_tokens or not len(dests):
        return
    src = Sources(*(t.contiguous() if t is not None else None for t in (src.x, src.topk, src.weights, src.scales)))
    x_words = src.x.shape[1]
    ids, floats = _meta_views(meta_out) if meta_out is not None else (x_out, x_out)
    num_k = src.topk.shape[1] if src.topk is not None else 0
    num_scales = src.scales.shape[1] if src.scales is not None else 0
    meta_words = meta_out.shape[1] // 8 if meta_out is not None else 0
    grid = (num_tokens, triton.cdiv(x_words, _X_BLOCK))
    args = (rows, src.x, x_out, x_words, src.topk if src.topk is not None else rows,
            src.weights if src.weights is not None else rows, src.scales if src.scales is not None else rows,
            ids, floats, num_k, num_scales, meta_words, meta_k, shift, dests.start, dests.stop, skip)
    launch(gather_kernel, grid, args, {
        "NUM_RANKS": num_ranks, "X_BLOCK": _X_BLOCK, "K_BLOCK": _pow2(num_k), "S_BLOCK": _pow2(num_scales),
        "HAS_TOPK": src.topk is not None, "HAS_W": src.weights is not None, "HAS_S": src.scales is not None})


def unpack(meta: torch.Tensor, meta_k: int, idx: torch.Tensor | None, w: torch.Tensor | None,
           scales: torch.Tensor | None, base: int, experts_per_rank: int, kernels=None) -> None:
    """Fill ``idx`` (local expert ids, -1 for experts elsewhere or masked), ``w`` (0 where ``idx``
    is -1) and ``scales`` from ``[N, meta_bytes]`` uint8 meta rows. ``w`` needs ``idx``."""
    kernels = kernels or (_kernels() if meta.is_cuda else None)
    if kernels is None:
        _unpack_torch(meta, meta_k, idx, w, scales, base, experts_per_rank)
        return
    triton, _, _, unpack_kernel = kernels
    total = meta.shape[0]
    if not total or (idx is None and scales is None):
        return
    ids, floats = _meta_views(meta)
    num_k = idx.shape[1] if idx is not None else 0
    num_scales = scales.shape[1] if scales is not None else 0
    args = (ids, floats, idx if idx is not None else ids, w if w is not None else floats,
            scales if scales is not None else floats, total, num_k, num_scales, meta.shape[1] // 8, meta_k, base,
            experts_per_rank)
    launch(unpack_kernel, (triton.cdiv(total, _UNPACK_ROWS),), args, {
        "ROWS": _UNPACK_ROWS, "K_BLOCK": _pow2(num_k), "S_BLOCK": _pow2(num_scales), "HAS_TOPK": idx is not None,
        "HAS_W": w is not None, "HAS_S": scales is not None})
