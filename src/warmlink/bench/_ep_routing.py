"""The inputs every ep bench rank draws: a random top-k routing and its tokens (``bench.ep``,
``bench.ep_lifecycle``)."""

from __future__ import annotations

__all__ = ["routing"]


def routing(rank: int, tokens: int, experts: int, topk: int, hidden: int, device):
    """``(x [tokens, hidden] bf16, topk_idx [tokens, topk], weights [tokens, topk] float32)`` of
    ``rank``, on ``device``: distinct experts per token, weights that sum to 1, a fixed seed per rank."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    scores = torch.rand(tokens, experts, generator=gen)
    weights, idx = scores.topk(topk, dim=1)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    return x.to(device), idx.to(device), (weights / weights.sum(1, keepdim=True)).float().to(device)
