"""``LowLatencyHandle``: what a low-latency dispatch leaves for its combine."""

from __future__ import annotations

import torch

__all__ = ["LowLatencyHandle"]


class LowLatencyHandle:
    """What ``low_latency_combine`` needs from its dispatch; also DeepEP's 5-tuple.

    ``handle[0]`` ... ``handle[4]`` (and unpacking) give DeepEP's ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``:

    - ``src_info``: int32 ``[L, R * T]``, the source token index of each received row;
    - ``layout_range``: int64 ``[L, R]``, ``(begin << 32) | count`` of source rank ``s``'s rows
      in expert ``e``'s block.

    Both are views of the Buffer's outputs of the dispatch's parity: valid until the dispatch two
    rounds later, as DeepEP's (a combine with an older handle raises ``ConfigError``). The rest is
    private to the Buffer: ``comb_slot`` (``t * K + k`` of each received row, where its combine
    row goes in its source), the rows of each source (host index tensors), the dispatch's top-k
    mask and the round and Buffer that made it.
    """

    __slots__ = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts",
                 "num_tokens", "num_topk", "round", "owner", "comb_slot", "rows_by_source", "dispatched")

    def __init__(self, src_info: torch.Tensor, layout_range: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                 hidden: int, num_experts: int, num_tokens: int, num_topk: int, round: int, owner: int,
                 comb_slot: torch.Tensor, dispatched: torch.Tensor) -> None:
        self.src_info = src_info
        self.layout_range = layout_range
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_tokens = num_tokens
        self.num_topk = num_topk
        self.round = round
        self.owner = owner
        self.comb_slot = comb_slot
        self.dispatched = dispatched
        self.rows_by_source: list[torch.Tensor] | None = None  # filled by the receive

    def _deepep(self) -> tuple:
        return (self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)

    def __getitem__(self, i):
        return self._deepep()[i]

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return iter(self._deepep())

    def __repr__(self) -> str:
        state = "received" if self.rows_by_source is not None else "awaiting its hook"
        return (f"ep.LowLatencyHandle(round={self.round}, tokens={self.num_tokens}, topk={self.num_topk}, "
                f"experts={self.num_experts}, hidden={self.hidden}, {state})")
