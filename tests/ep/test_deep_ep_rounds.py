"""A batch larger than a deep_ep Buffer's budget holds goes in several rounds (deep_ep.rounds,
Note [Rounds beyond the budget]) and gives exactly what one round gives: fresh and cached
dispatch, FP8, a dispatch without top-k, padded outputs and combine with weights, with ranks that
hold different token counts (one of them none). Spawned ranks over a gloo group on the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ep._deep_ep_rounds import later_batch_in_rounds, rounds_equal_one_round
from tests.ep._deep_ep_workers import free_port
from tests.ep._group import run_ranks
from warmlink.ep.deep_ep.rounds import _round_counts
from warmlink.ep.deep_ep.sizing import needed_bytes
from warmlink.ep.kernels.layout import dispatch_layout


def test_several_rounds_give_exactly_what_one_round_gives():
    case = {"tokens": [23, 9, 0], "held": 4, "hidden": 256, "experts": 6, "topk": 2, "seed": 13, "dist_port": free_port()}
    for rank, got in enumerate(run_ranks(rounds_equal_one_round, 3, case=case, timeout_s=240)):
        # rank 1 passed a wrong is_token_in_rank: it says what; the others say who, at once
        expected = "is_token_in_rank has shape" if rank == 1 else "ranks [1] refused their arguments"
        assert expected in got["one_bad_rank"] and got["after_bad"], got
        # padded, there is no meeting first: rank 1 refuses in the round itself, and every rank raises at once
        expected = "is_token_in_rank has shape" if rank == 1 else "ranks [1] refused their dispatch arguments"
        assert expected in got["one_bad_rank_padded"] and got["after_bad_padded"], got
        assert (got["padded_meets"], got["unpadded_meets"], got["one_round_meets"]) == (0, 1, 0), got
        assert got["one_round_same"], got
        assert {k: got[k] for k in ("dispatch", "combine", "cached", "fp8", "no_topk", "padded", "padded_combine")} == {
            k: True for k in ("dispatch", "combine", "cached", "fp8", "no_topk", "padded", "padded_combine")}, got
        assert got["rounds"] == (None, 6), got  # ceil(23 / 4): every rank runs the most any rank needs
        one, many = got["too_few_worst"]
        assert one.startswith("ConfigError") and "num_worst_tokens=1" in one, got
        # num_worst_tokens=1 gives one round of 4 tokens: ranks 0 and 1 hold more and refuse, rank 2 hears it
        expected = "num_worst_tokens=1 at 3 ranks sends 1 round" if rank < 2 else "ranks [0, 1] refused their dispatch"
        assert many.startswith("ConfigError") and expected in many, got
        # the Buffer inside stays within the budget, as large as it holds
        assert got["inner_tokens"] == 4 and got["inner_bytes"] <= got["budget"] < needed_bytes(5, 3, 256, 2), got
        assert "rounds=6" in got["repr"], got


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 4), st.data())
def test_every_rounds_counts_in_one_pass_equal_a_layout_per_round(num_tokens, cap, num_ranks, data):
    """The counts each round sends (deep_ep.rounds._round_counts) equal ``dispatch_layout`` of the
    round's tokens, -1 and out-of-range ids included (neither is counted)."""
    experts = num_ranks * data.draw(st.integers(1, 3))
    topk = data.draw(st.integers(1, 3))
    ids = data.draw(st.lists(st.integers(-2, experts), min_size=num_tokens * topk, max_size=num_tokens * topk))
    topk_idx = torch.tensor(ids, dtype=torch.int64).view(num_tokens, topk)
    in_rank = dispatch_layout(topk_idx, experts, num_ranks).is_token_in_rank
    num_rounds = -(-num_tokens // cap)
    per_rank, per_expert = _round_counts(in_rank, topk_idx, experts, cap, num_rounds)
    _, no_topk = _round_counts(in_rank, None, experts, cap, num_rounds)
    assert no_topk is None
    for k in range(num_rounds):
        lay = dispatch_layout(topk_idx[k * cap:(k + 1) * cap], experts, num_ranks)
        assert torch.equal(per_rank[k], in_rank[k * cap:(k + 1) * cap].sum(0, dtype=torch.int32))
        assert torch.equal(per_expert[k], lay.num_tokens_per_expert)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**7), st.integers(1, 64), st.integers(1, 5000), st.integers(0, 10**6))
def test_a_padded_dispatch_takes_the_fewest_rounds_that_hold_its_share_of_num_worst_tokens(worst, num_ranks, cap, tokens):
    """Every rank computes the same rounds from ``num_worst_tokens`` alone: the fewest that hold
    ``ceil(W / R)`` tokens per rank, and a rank whose batch they do not hold refuses, saying why."""
    from types import SimpleNamespace

    from warmlink.ep.deep_ep.rounds import padded_rounds

    inner = SimpleNamespace(num_ranks=num_ranks, layout=SimpleNamespace(max_tokens=cap))
    rounds, problem = padded_rounds(inner, worst, tokens)
    share = -(-worst // num_ranks)
    assert rounds >= 1 and rounds * cap >= share and (rounds == 1 or (rounds - 1) * cap < share)
    assert (problem is None) == (tokens <= rounds * cap)
    if problem:
        assert f"num_worst_tokens={worst}" in problem and f"x has {tokens} tokens" in problem


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])], ids=["shm", "gpu"])
def test_a_batch_that_fits_one_round_meets_nobody_and_a_later_larger_one_goes_in_rounds(cuda, monkeypatch):
    """A slot Buffer built for 4 tokens a round: batches that fit are one round and no host meet;
    a later batch of 9 tokens on rank 0 is first refused on every rank, then one meet, then 3
    rounds; every dispatch and combine equals the reference, and the batch after fits again."""
    monkeypatch.setenv("WARMLINK_EP_STREAM_KERNEL", "triton")  # slots on GPUs too (the CUDA kernels stream: deep_ep.inner)
    case = {"held": 4, "hidden": 256, "experts": 6, "topk": 2, "seed": 31, "dist_port": free_port(), "cuda": cuda,
            "batches": [[3, 4], [4, 1], [9, 2], [2, 0], [0, 4]]}
    for rank, steps in enumerate(run_ranks(later_batch_in_rounds, 2, case=case, timeout_s=240)):
        assert [s["meets"] for s in steps[1:]] == [0, 1, 0, 0], (rank, steps)  # (the first builds the Buffer)
        assert [s["rounds"] for s in steps] == [None, None, 3, None, None], (rank, steps)
        assert not any(s["streamed"] for s in steps), (rank, steps)
        assert all(s["dispatch"] and s["combine"] for s in steps), (rank, steps)
