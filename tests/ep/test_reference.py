"""The EP oracle itself, checked on a case small enough to compute by hand."""

from __future__ import annotations

import pytest
import torch

from ._reference import (
    decode_token_pattern,
    random_routing,
    reference_combine,
    reference_dispatch,
    reference_layout,
    token_pattern,
)

# 2 ranks, 4 experts (experts 0, 1 on rank 0; 2, 3 on rank 1), 3 tokens per rank, top-2.
TOPK = [
    torch.tensor([[0, 3], [1, -1], [-1, -1]]),  # token 2 goes nowhere
    torch.tensor([[2, 3], [0, 2], [-1, 1]]),
]
# Masked and foreign slots carry non-zero weights on purpose: they must come out as 0.
WEIGHTS = [
    torch.tensor([[0.5, 0.25], [1.0, 0.75], [0.125, 0.375]]),
    torch.tensor([[2.0, 4.0], [0.5, 1.5], [3.0, 0.25]]),
]


def _x(rank: int) -> torch.Tensor:
    """Row t of rank s is [10 s + t, -(10 s + t)]."""
    v = torch.arange(3, dtype=torch.float32) + 10 * rank
    return torch.stack([v, -v], dim=1).to(torch.bfloat16)


def test_layout_by_hand():
    per_rank, per_expert, in_rank = reference_layout(TOPK[0], 4, 2)
    assert per_rank.tolist() == [2, 1]
    assert per_expert.tolist() == [1, 1, 0, 1]
    assert in_rank.tolist() == [[True, True], [True, False], [False, False]]
    per_rank, per_expert, in_rank = reference_layout(TOPK[1], 4, 2)
    assert per_rank.tolist() == [2, 2]
    assert per_expert.tolist() == [1, 1, 2, 1]
    assert in_rank.tolist() == [[False, True], [True, True], [True, False]]
    assert per_rank.dtype == per_expert.dtype == torch.int64 and in_rank.dtype == torch.bool


def test_dispatch_by_hand():
    r0, r1 = reference_dispatch([_x(0), _x(1)], TOPK, WEIGHTS, 4)
    assert r0["recv_src"] == [(0, 0), (0, 1), (1, 1), (1, 2)]
    assert r0["recv_x"].tolist() == [[0, 0], [1, -1], [11, -11], [12, -12]]
    assert r0["recv_x"].dtype == torch.bfloat16
    assert r0["recv_topk_idx"].tolist() == [[0, -1], [1, -1], [0, -1], [-1, 1]]
    assert r0["recv_topk_weights"].tolist() == [[0.5, 0], [1.0, 0], [0.5, 0], [0, 0.25]]
    assert r0["num_recv_tokens_per_expert_list"] == [2, 2]

    assert r1["recv_src"] == [(0, 0), (1, 0), (1, 1)]
    assert r1["recv_x"].tolist() == [[0, 0], [10, -10], [11, -11]]
    assert r1["recv_topk_idx"].tolist() == [[-1, 1], [0, 1], [-1, 0]]
    assert r1["recv_topk_weights"].tolist() == [[0, 0.25], [2.0, 4.0], [0, 1.5]]
    assert r1["num_recv_tokens_per_expert_list"] == [2, 2]


def test_combine_by_hand():
    recv = reference_dispatch([_x(0), _x(1)], TOPK, WEIGHTS, 4)
    ys = [r["recv_x"] + 100 * (d + 1) for d, r in enumerate(recv)]  # which receiver a row came back from
    o0, o1 = reference_combine(ys, [r["recv_src"] for r in recv], [3, 3], [r["recv_topk_weights"] for r in recv])
    assert o0["out"].tolist() == [[300, 300], [101, 99], [0, 0]]
    assert o1["out"].tolist() == [[210, 190], [322, 278], [112, 88]]
    assert o0["out"].dtype == torch.bfloat16
    assert o0["combined_weights"].tolist() == [[0.5, 0.25], [1.0, 0], [0, 0]]
    assert o1["combined_weights"].tolist() == [[2.0, 4.0], [0.5, 1.5], [0, 0.25]]
    no_w = reference_combine(ys, [r["recv_src"] for r in recv], [3, 3])
    assert no_w[0]["combined_weights"] is None and torch.equal(no_w[0]["out"], o0["out"])


def test_dispatch_empty_rank_and_fp8():
    xs = [token_pattern(0, 0, 128, torch.float8_e4m3fn), token_pattern(1, 3, 128, torch.float8_e4m3fn)]
    topk = [torch.empty(0, 2, dtype=torch.int64), TOPK[1]]
    r0, r1 = reference_dispatch(xs, topk, None, 4)
    assert r0["recv_src"] == [(1, 1), (1, 2)] and r1["recv_src"] == [(1, 0), (1, 1)]
    assert r0["recv_x"][0].dtype == torch.float8_e4m3fn and r0["recv_x"][1].shape == (2, 1)
    assert r0["recv_topk_weights"] is None
    for r in (r0, r1):
        ranks, tokens = decode_token_pattern(r["recv_x"])
        assert list(zip(ranks.tolist(), tokens.tolist())) == r["recv_src"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_token_pattern_round_trip(dtype):
    x = token_pattern(200, 5000, 256, dtype)
    ranks, tokens = decode_token_pattern(x)
    assert ranks.tolist() == [200] * 5000 and tokens.tolist() == list(range(5000))
    rows = (x[0][[7, 4999]], x[1][[7, 4999]]) if isinstance(x, tuple) else x[[7, 4999]]
    assert decode_token_pattern(rows)[1].tolist() == [7, 4999]


def test_token_pattern_detects_corruption():
    x = token_pattern(3, 10, 16, torch.bfloat16)
    x[4, 9] += 1
    with pytest.raises(ValueError, match="row 4"):
        decode_token_pattern(x)
    x8, scales = token_pattern(3, 10, 128, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="row 0"):
        decode_token_pattern((x8, scales.flip(0)))
    with pytest.raises(ValueError, match="hidden=100"):
        token_pattern(0, 1, 100, torch.float8_e4m3fn)


def test_random_routing():
    gen = torch.Generator().manual_seed(0)
    idx = random_routing(1000, 16, 4, gen, mask_prob=0.25)
    assert idx.shape == (1000, 4) and idx.dtype == torch.int64
    assert idx.min() >= -1 and idx.max() < 16
    for row in idx.tolist():
        kept = [e for e in row if e != -1]
        assert len(set(kept)) == len(kept)
    assert 0.15 < (idx == -1).float().mean() < 0.35
    assert torch.equal(idx, random_routing(1000, 16, 4, torch.Generator().manual_seed(0), mask_prob=0.25))
    assert (random_routing(50, 8, 8, gen) >= 0).all()


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        reference_layout(torch.tensor([[0, 4]]), 4, 2)
    with pytest.raises(ValueError, match="repeats an expert"):
        reference_layout(torch.tensor([[1, 1]]), 4, 2)
    with pytest.raises(ValueError, match="num_experts % num_ranks"):
        reference_layout(torch.tensor([[1, 2]]), 5, 2)
    with pytest.raises(ValueError, match="rows of x"):
        reference_dispatch([_x(0), _x(1)[:2]], TOPK, WEIGHTS, 4)
