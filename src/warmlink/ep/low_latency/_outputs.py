"""The outputs of low-latency dispatch, allocated once per parity (See Note [Low-latency layout]).

A call with ``num_max_dispatch_tokens_per_rank = Tc`` (at most the Buffer's ``T``) returns
contiguous views of the front of its parity's storage, shaped for ``Tc``, so that every call of a
parity returns the same addresses (a captured graph replays into them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from warmlink.ep.low_latency._layout import LL_PARITIES, LowLatencyLayout

__all__ = ["Outputs", "ParityViews"]


@dataclass(frozen=True)
class ParityViews:
    """The views one call fills: ``x`` (BF16 ``[L, R*Tc, H]`` or FP8 data of that shape),
    ``scales`` (float32 ``[L, R*Tc, S]`` or int32 ``[L, R*Tc, ceil(S/4)]``, column-major in the last two
    dimensions as DeepEP's, or None), ``count`` int32 ``[L]``, ``src_info`` int32 ``[L, R*Tc]``,
    ``layout_range`` int64 ``[L, R]``, ``comb_slot`` int64 ``[L, R*Tc]``, ``dispatched`` bool ``[T, K]``."""

    x: torch.Tensor
    scales: torch.Tensor | None
    count: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor
    comb_slot: torch.Tensor
    dispatched: torch.Tensor


class Outputs:
    """Both parities' output storage of one rank, on ``device`` (-1 = host), zeroed at first."""

    def __init__(self, layout: LowLatencyLayout, device: int) -> None:
        on = torch.device("cpu") if device < 0 else torch.device("cuda", device)
        self.layout = layout
        rows = layout.slots

        def each(numel: int, dtype) -> list[torch.Tensor]:
            return [torch.zeros(numel, dtype=dtype, device=on) for _ in range(LL_PARITIES)]

        self._x = each(rows * layout.row_bytes, torch.uint8)
        self._scales = each(rows * layout.num_scales, torch.float32)
        self._packed = each(rows * layout.num_packed_scales, torch.int32)
        self._count = each(layout.local_experts, torch.int32)
        self._src_info = each(rows, torch.int32)
        self._comb_slot = each(rows, torch.int64)
        self._layout_range = each(layout.num_experts, torch.int64)
        self._dispatched = each(layout.max_tokens * layout.num_topk, torch.bool)
        self._views: dict[tuple, ParityViews] = {}
        self._dispatched_views: dict[tuple, torch.Tensor] = {}
        self._device = on
        self._combine: list[torch.Tensor | None] = [None] * LL_PARITIES  # zero-copy combine buffers, made on first use

    def views(self, p: int, tokens: int, fp8: bool, ue8m0: bool) -> ParityViews:
        """The views of parity ``p`` for a call of ``tokens`` (made once per shape: the storage is fixed)."""
        key = (p, tokens, fp8, ue8m0)
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = self._make_views(p, tokens, fp8, ue8m0)
        return got

    def dispatched(self, p: int, tokens: int, num_topk: int) -> torch.Tensor:
        """Parity ``p``'s top-k mask of a dispatch of ``tokens`` tokens and ``num_topk`` columns, a
        ``[tokens, num_topk]`` view of its ``[T, K]`` (made once per shape)."""
        key = (p, tokens, num_topk)
        got = self._dispatched_views.get(key)
        if got is None:
            got = self._dispatched_views[key] = self._dispatched[p].view(self.layout.max_tokens,
                                                                          self.layout.num_topk)[:tokens, :num_topk]
        return got

    def _make_views(self, p: int, tokens: int, fp8: bool, ue8m0: bool) -> ParityViews:
        lay = self.layout
        num_local, per_expert, hidden = lay.local_experts, lay.num_ranks * tokens, lay.hidden
        rows = num_local * per_expert
        if fp8:
            x = self._x[p][:rows * hidden].view(torch.float8_e4m3fn).view(num_local, per_expert, hidden)
            store, cols = (self._packed[p], lay.num_packed_scales) if ue8m0 else (self._scales[p], lay.num_scales)
            scales = store[:rows * cols].view(num_local, cols, per_expert).transpose(1, 2)
        else:
            x = self._x[p][:rows * hidden * 2].view(torch.bfloat16).view(num_local, per_expert, hidden)
            scales = None
        return ParityViews(x, scales, self._count[p], self._src_info[p][:rows].view(num_local, per_expert),
                           self._layout_range[p].view(num_local, lay.num_ranks),
                           self._comb_slot[p][:rows].view(num_local, per_expert),
                           self._dispatched[p].view(lay.max_tokens, lay.num_topk))

    def combine_buffer(self, p: int, tokens: int, make: bool) -> torch.Tensor | None:
        """Parity ``p``'s zero-copy combine buffer, BF16 ``[L, R*tokens, H]`` contiguous (the front of
        its storage), made now when ``make``; None when it was never made."""
        lay = self.layout
        if self._combine[p] is None:
            if not make:
                return None
            self._combine[p] = torch.empty(lay.slots * lay.hidden, dtype=torch.bfloat16, device=self._device)
        rows = lay.local_experts * lay.num_ranks * tokens
        return self._combine[p][:rows * lay.hidden].view(lay.local_experts, lay.num_ranks * tokens, lay.hidden)

    def zero(self) -> None:
        for group in (self._x, self._scales, self._packed, self._count, self._src_info, self._comb_slot,
                      self._layout_range, self._dispatched):
            for t in group:
                t.zero_()
