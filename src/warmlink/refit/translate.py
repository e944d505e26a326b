"""Receiver-side local work after the pull: un-stage, cast, and install into the model.

All functions run on the receiver's device (its current CUDA stream, or the CPU) and touch only
memory the receiver owns.
"""

from __future__ import annotations

from typing import Callable, Iterable

from warmlink._dtypes import torch_dtype
from warmlink._geometry import pad_shape

__all__ = ["box_slices", "unstage", "install_copy", "install_swap"]


def box_slices(box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def unstage(tensor_plan, recv_view, scratch) -> None:
    """Copy the boxes of staged pulls from ``scratch`` (uint8) into ``recv_view`` (typed)."""
    dtype = torch_dtype(tensor_plan.src_dtype)
    for sp in tensor_plan.staged:
        src = scratch[sp.scratch_offset : sp.scratch_offset + sp.src_nbytes].view(dtype)
        for src_box, dst_box in sp.local_copies:
            dst = (recv_view.view(pad_shape(tensor_plan.dst_shape, len(dst_box))) if sp.dst_perm is None
                   else box_order_view(recv_view.view(tensor_plan.dst_shape), sp.dst_perm, len(dst_box)))
            dst[box_slices(dst_box)].copy_(src.view(pad_shape(sp.src_local_shape, len(src_box)))[box_slices(src_box)])


def box_order_view(physical, perm: tuple[int, ...], ndim: int):
    """``physical``, which holds a transposed part, seen in the order of the part's box dimensions
    (``physical.permute(argsort(perm))``) with leading 1s up to ``ndim`` dimensions: a view, so a
    copy into it permutes the bytes into place (Note [Transposed parts] in ``refit.manifest``)."""
    view = physical.permute(sorted(range(len(perm)), key=perm.__getitem__))
    for _ in range(ndim - view.dim()):
        view = view.unsqueeze(0)
    return view


def install_copy(pairs: Iterable[tuple[object, object]]) -> None:
    """``target.copy_(source)`` for each pair: addresses of targets stay (safe for CUDA graphs)."""
    for target, source in pairs:
        target.copy_(source)


def install_swap(pairs: Iterable[tuple[object, object]]) -> None:
    """Point each target's ``.data`` at the received buffer: no bytes move.

    The model then lives in receiver-owned double buffers; anything that captured the old
    addresses (CUDA graphs) must use ``install="copy"`` instead.
    """
    for target, source in pairs:
        target.data = source


def call_load_weights(load_weights: Callable, named: Iterable[tuple[str, object]]) -> None:
    """Hand ``(name, tensor)`` pairs to a vLLM/SGLang-style ``load_weights`` (it copies them)."""
    load_weights(iter(list(named)))
