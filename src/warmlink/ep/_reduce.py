"""Combine's last step: each token sums the copies its expert ranks sent back.

``rows[t, d]`` is the row of token ``t``'s copy from rank ``d`` in the combine area, or -1 (see
``ep._kernels.plan``). Sums run in float32 in rank order, so results are identical run to run.
On CUDA a Triton kernel (ep._triton.sum_kernel) reads each copy once (one pass over the received
bytes); elsewhere, or without Triton, the same sum in torch ops.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["combine_sum"]


def _torch_sum(area: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, local) -> None:
    num_tokens, num_ranks = rows.shape
    acc = torch.zeros(num_tokens, area.shape[1], dtype=torch.float32, device=area.device)
    for d in range(num_ranks):  # rank order: deterministic
        r = rows[:, d]
        src = area
        if local is not None and d == local[1]:
            src, r = local[0], torch.where(r >= 0, r + local[2], -1)
        if not src.shape[0]:  # nothing came from there (index_select refuses an empty source)
            continue
        acc += src.index_select(0, r.clamp(min=0)).float() * (r >= 0).unsqueeze(1)
    out.copy_(acc)


@functools.cache
def _triton_kernel():
    try:
        import triton
    except ImportError:
        return None
    return _build(triton)


def _build(triton):
    """``(triton, kernel)``; the kernel is in ep._triton, where the interpreter finds its helper."""
    import os

    from warmlink.ep import _triton
    from warmlink.ep._launch import FastLaunch

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return triton, (_triton.sum_kernel if interpreted else FastLaunch(_triton.sum_kernel))


_BLOCK = 1024


def combine_sum(area: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, local=None, use_triton: bool = True,
                kernels=None) -> None:
    """``out[t] = sum over d with rows[t, d] >= 0 of area[rows[t, d]]``: float32 sums in rank order,
    stored in ``out``'s dtype (zeros for tokens that went nowhere).

    Args:
        area: ``[N, H]`` received rows (the combine area, typed).
        rows: ``[T, R]`` int64 rows into ``area``, -1 where absent.
        out: ``[T, H]`` contiguous result, written in full.
        local: ``(rows_here [M, H], rank, shift)``: column ``rank`` reads ``rows_here[rows[t, rank] +
            shift]`` instead (this rank's own contribution, never copied into the area), or None.
        use_triton: use the Triton kernel on CUDA when it loads. kernels: ``_build``'s, for tests.
    """
    kernel = kernels or (_triton_kernel() if use_triton and area.is_cuda else None)
    if kernel is None:
        _torch_sum(area, rows, out, local)
        return
    triton, sum_kernel = kernel
    num_tokens, num_ranks = rows.shape
    hidden = area.shape[1]
    if not num_tokens:
        return
    from warmlink.ep._launch import launch

    here, rank, shift = local if local is not None else (area, -1, 0)
    launch(sum_kernel, (num_tokens, triton.cdiv(hidden, _BLOCK)),
           (area, rows.contiguous(), out, here.contiguous(), rank, shift, hidden), {"num_ranks": num_ranks, "block": _BLOCK})
