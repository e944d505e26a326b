"""The tensors a dispatch returns, and the receive-phase step that fills them (the unpack)."""

from __future__ import annotations

import torch

from warmlink.ep.kernels.call_block import Padded
from warmlink.ep.kernels.steps import unpack as unpack_meta
from warmlink.ep.wire.fp8 import num_scales
from warmlink.ep.wire.handle import Handle
from warmlink.ep.wire.regions import RegionLayout

__all__ = ["dispatch_outputs"]


def dispatch_outputs(view, layout: RegionLayout, rank: int, num_ranks: int, handle: Handle, parts: tuple[str, str],
                     dtype: torch.dtype, fp8: bool, with_topk: bool, with_weights: bool):
    """``(recv_x, recv_topk_idx, recv_topk_weights, unpack, writes)``: ``recv_x`` is a view of the
    receive area (``view``: the mover's ``own_view``); ``unpack``, the receive-phase step, fills
    the other outputs (and FP8 scales), ``writes``, made now so that hook mode can return them
    before the bytes land (None when there is nothing to unpack), with what the unpack reads
    beside them. With ``num_worst_tokens`` the outputs have that many rows; the rows past the
    received ones get expert id -1 and weight 0: now, on the caller's stream, or, for a handle
    still pending (ep.protocol.normal, Note [Padded dispatch returns at launch]), by the unpack, which
    reads the rows received from the handle's board on the device."""
    lay, pending = layout, handle.pending is not None
    total = handle.num_worst_tokens if pending else handle.num_recv_tokens
    rows = handle.num_worst_tokens or total
    x = view(parts[0], torch.float8_e4m3fn if fp8 else dtype, lay.hidden)[:rows]
    meta = view(parts[1], torch.uint8, lay.meta_bytes)[:total]
    kt, dev = handle.num_topk, x.device
    idx = torch.empty(rows, kt, dtype=torch.int64, device=dev) if with_topk else None
    w = torch.empty(rows, kt, dtype=torch.float32, device=dev) if with_weights else None
    scales = torch.empty(rows, num_scales(lay.hidden), dtype=torch.float32, device=dev) if fp8 else None
    received = (idx, w, scales)
    if rows > total:  # padded: the receive work fills the first rows, the rest are filled now
        for t, fill in ((idx, -1), (w, 0)):
            if t is not None:
                t[total:].fill_(fill)
        received = tuple(t[:total] if t is not None else None for t in received)
    epr = handle.num_experts // num_ranks
    padded = Padded(handle.board, handle.round, rank) if pending else None

    def unpack() -> None:
        unpack_meta(meta, lay.num_topk, *received, rank * epr, epr, padded=padded)

    busy = total and (idx is not None or scales is not None)
    return ((x, scales) if fp8 else x), idx, w, (unpack if busy else None), (idx, w, scales, handle.board)
