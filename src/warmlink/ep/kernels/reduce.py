"""Combine's last step: each token sums the copies its expert ranks sent back.

``rows[t, d]`` is the row of token ``t``'s copy from rank ``d`` in the combine area, or -1 (see
``ep.kernels.steps.plan``). Sums run in float32 in rank order, so results are identical run to run.
On CUDA a Triton kernel (ep.kernels.sum_programs.sum_kernel) reads each copy once (one pass over the received
bytes); elsewhere, or without Triton, the same sum in torch ops.

# Note [Pipelined combine]
The sum used to start once every copy landed: 0.08-0.10 ms after 0.44-0.47 ms of copies on
4 x H200, so it was a sixth of the combine. Now each rank sends the ``n`` rows it owes a source in
``PARTS`` parts (``part_bounds``: row ``p`` goes in part ``p * PARTS // n``), each marked with its
own event (``part_phase``), and the source sums, part by part behind those events, the tokens
whose last copy came in that part (``token_part``). Rows keep their source-token order in every
part, so a token's copies land in about the same part from every rank, and only the last part's
tokens are summed after the last byte. The split needs no word on the wire: both sides know
``n`` (the sender received it, the source sent it) and the rule.

A group of two ranks combines in one part: its copies take ~0.18 ms, less than the host work the
parts add (a batch of copies, events and a sum launch per part). On 2 x H200 four parts were
slower than one at the median of ten paired runs on a fast host (by 8%) and in all four paired
runs on slower hosts (by 6-58%; benchmarks/history-2026-11-24.md). The parts are for three ranks and more, whose
copies take 0.44 ms and up at the bench shapes.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PARTS", "combine_sum", "part_bounds", "part_phase", "part_sums"]

PARTS = 4  # Note [Pipelined combine]


def part_bounds(count: int, parts: int = PARTS) -> list[int]:
    """Row bounds of the ``parts`` parts of ``count`` rows: part ``k`` is rows ``[b[k], b[k + 1])``
    with ``b[k] = ceil(k * count / parts)``, so row ``p`` is in part ``p * parts // count``."""
    return [-(-k * count // parts) for k in range(parts + 1)]


def part_phase(k: int, parity: int, parts: int = PARTS) -> str:
    """The event phase marking part ``k`` of a combine of ``parity``: the last is the combine's own."""
    return f"combine.{parity}" if k == parts - 1 else f"combine_part{k}.{parity}"


def token_parts(rows: torch.Tensor, counts: torch.Tensor, local_rank: int, slot_rows: int, parts: int) -> torch.Tensor:
    """``[T]`` the part whose arrival completes each token's copies (ep.kernels.sum_programs.token_part)."""
    num_ranks = rows.shape[1]
    ranks = torch.arange(num_ranks, device=rows.device)
    pos = rows - ranks * slot_rows
    peer = (rows >= 0) & (ranks != local_rank)
    part = torch.where(peer, pos * parts // counts.to(rows.device, torch.int64).clamp(min=1), 0)
    return part.amax(1)


def _torch_sum(area: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, local, tokens: torch.Tensor | None) -> None:
    if tokens is not None:  # only these tokens (one part's)
        rows = rows[tokens]
    num_tokens, num_ranks = rows.shape
    acc = torch.zeros(num_tokens, area.shape[1], dtype=torch.float32, device=area.device)
    for d in range(num_ranks):  # rank order: deterministic
        r = rows[:, d]
        src = area
        if local is not None and d == local[1]:
            src, r = local[0], torch.where(r >= 0, r + local[2], -1)
        if not src.shape[0]:  # nothing came from there (index_select refuses an empty source)
            continue
        # a token without a copy there reads another token's row (row 0): select, never multiply
        # by 0, since 0 x NaN (or inf) is NaN and would spread one bad token into the others
        acc += torch.where((r >= 0).unsqueeze(1), src.index_select(0, r.clamp(min=0)).float(), 0.0)
    if tokens is None:
        out.copy_(acc)
    else:
        out[tokens] = acc.to(out.dtype)


@functools.cache
def _triton_kernel():
    try:
        triton, kernel = _build()
    except ImportError:
        return None
    from warmlink.ep.kernels.launch import FastLaunch

    return triton, FastLaunch(kernel)


def _build():
    """``(triton, plain jit kernel)``; the kernel lives in ep.kernels.sum_programs, where the interpreter
    finds its helpers (tests run it there, unwrapped)."""
    import triton

    from warmlink.ep.kernels import sum_programs

    return triton, sum_programs.sum_kernel


_BLOCK = 1024


def combine_sum(area: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, local=None, *, counts=None,
                slot_rows: int = 0, part: int = 0, parts: int = 1, use_triton: bool = True, kernels=None) -> None:
    """``out[t] = sum over d with rows[t, d] >= 0 of area[rows[t, d]]``: float32 sums in rank order,
    stored in ``out``'s dtype (zeros for tokens that went nowhere).

    Args:
        area: ``[N, H]`` received rows (the combine area, typed).
        rows: ``[T, R]`` int64 rows into ``area``, -1 where absent.
        out: ``[T, H]`` contiguous result: written in full, or with ``parts > 1`` the rows of the
            tokens whose last copy comes in part ``part`` (Note [Pipelined combine]).
        local: ``(rows_here [M, H], rank, shift)``: column ``rank`` reads ``rows_here[rows[t, rank] +
            shift]`` instead (this rank's own contribution, never copied into the area), or None.
        counts, slot_rows: with ``parts > 1``, ``[R]`` the rows each rank sent back, on ``area``'s
            device, and the rows of one rank's slot (rank ``d``'s copies are rows ``d * slot_rows ...``).
        use_triton: use the Triton kernel on CUDA when it loads. kernels: ``_build``'s, for tests.
    """
    part_sums(area, rows, out, local, counts=counts, slot_rows=slot_rows, parts=parts, use_triton=use_triton,
              kernels=kernels)[part]()


def part_sums(area: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, local=None, *, counts=None,
              slot_rows: int = 0, parts: int = 1, use_triton: bool = True, kernels=None) -> list:
    """``combine_sum`` of each part as a callable, its arguments made once: a combine's receive
    launches one per part, and every launch is host time on the way to the last sum."""
    if parts > 1 and counts is None:
        raise ValueError("combine_sum: parts > 1 needs the counts each rank sent back")
    kernel = kernels or (_triton_kernel() if use_triton and area.is_cuda else None)
    if kernel is None:
        if parts == 1:
            return [lambda: _torch_sum(area, rows, out, local, None)]
        of_token = token_parts(rows, counts, local[1] if local is not None else -1, slot_rows, parts)
        return [lambda k=k: _torch_sum(area, rows, out, local, (of_token == k).nonzero().squeeze(1)) for k in range(parts)]
    _, sum_kernel = kernel
    num_tokens, hidden = rows.shape[0], area.shape[1]
    if not num_tokens:
        return [lambda: None] * parts
    from warmlink.ep.kernels.launch import launch

    here, rank, shift = local if local is not None else (area, -1, 0)
    grid = (num_tokens,)
    head = (area, rows.contiguous(), out, here.contiguous(), rank, shift, hidden, rows if counts is None else counts)
    constexprs = {"num_ranks": rows.shape[1], "parts": parts, "block": _BLOCK}
    return [lambda k=k: launch(sum_kernel, grid, (*head, k, slot_rows), constexprs) for k in range(parts)]
