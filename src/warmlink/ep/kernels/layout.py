"""Where every token goes: the dispatch layout, in one kernel on CUDA (ep.kernels.steps.layout) and in
torch ops elsewhere (the send plan: ep.kernels.steps.plan).

Nothing here synchronizes with the host: out-of-range expert ids are routed to a dump column
(and counted) instead of indexing out of bounds, so a bad id can never fault a kernel; ``dispatch``
reads the count with the other counts it needs on the host and raises before any byte moves.

# Note [Send order]
Rank ``s`` sends to rank ``d`` the tokens ``t`` with ``is_token_in_rank[t, d]``, in ascending ``t``,
and writes them at rows ``sum(counts[s'][d] for s' < s) + pos[t, d]`` of ``d``'s receive region,
where ``pos[t, d]`` is ``t``'s rank among those tokens. So a receiver's rows come out ordered by
source rank, then source token index (DeepEP's normal-mode order) with no unpack step, and the
combine of token ``t`` finds its copy from ``d`` at row ``pos[t, d]`` of the slot ``d`` wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DispatchLayout", "dispatch_layout"]


@dataclass(frozen=True)
class DispatchLayout:
    """What ``get_dispatch_layout`` returns, on the device of ``topk_idx``.

    Attributes:
        num_tokens_per_rank: ``[R]`` int32, tokens with at least one expert on each rank.
        num_tokens_per_expert: ``[E]`` int32, (token, expert) pairs per expert.
        is_token_in_rank: ``[T, R]`` bool.
        num_bad_ids: ``[1]`` int32, entries outside ``[-1, E)`` (routed nowhere).
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor
    num_bad_ids: torch.Tensor


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, kernels=None) -> DispatchLayout:
    """Count tokens per rank and per expert; ``-1`` entries are masked (routed nowhere).

    Args:
        topk_idx: ``[T, K]`` integer expert ids in ``[-1, num_experts)``.
        num_experts: total experts, a multiple of ``num_ranks``.
        num_ranks: ranks of the group.

        kernels: ep's kernels (tests pass the interpreter's); default: Triton's on CUDA, else torch.

    Returns:
        A ``DispatchLayout``; ids outside ``[-1, num_experts)`` are counted in ``num_bad_ids`` only.
    """
    from warmlink.ep.kernels import steps

    kernels = kernels or (steps._kernels() if topk_idx.is_cuda else None)
    if kernels is not None:
        per_rank, per_expert, in_rank, bad = steps.layout(topk_idx, num_experts, num_ranks, kernels)
        return DispatchLayout(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                              num_bad_ids=bad)
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    idx = topk_idx.long()
    bad = (idx < -1) | (idx >= num_experts)
    valid = (idx >= 0) & ~bad
    dev = idx.device
    # Masked and bad entries go to a dump column that is sliced off.
    rank_of = torch.where(valid, idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=dev)
    in_rank.scatter_(1, rank_of, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    expert = torch.where(valid, idx, num_experts).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    per_expert.scatter_add_(0, expert, torch.ones_like(expert, dtype=torch.int32))
    return DispatchLayout(
        num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32),
        num_tokens_per_expert=per_expert[:num_experts],
        is_token_in_rank=in_rank,
        num_bad_ids=bad.sum(dtype=torch.int32).reshape(1),
    )
