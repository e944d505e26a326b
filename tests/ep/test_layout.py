"""ep.kernels.layout against the oracle, fuzzed with hypothesis."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ep._reference import random_routing, reference_layout
from warmlink.ep.kernels.layout import dispatch_layout
from warmlink.ep.kernels.steps import plan


@st.composite
def routings(draw):
    num_ranks = draw(st.integers(1, 6))
    num_experts = num_ranks * draw(st.integers(1, 8))
    topk = draw(st.integers(1, min(num_experts, 8)))
    tokens = draw(st.integers(0, 40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    idx = random_routing(tokens, num_experts, topk, gen, draw(st.sampled_from([0.0, 0.3, 1.0])))
    return idx, num_experts, num_ranks


@settings(max_examples=150, deadline=None)
@given(routings())
def test_layout_matches_the_reference(case):
    idx, num_experts, num_ranks = case
    lay = dispatch_layout(idx, num_experts, num_ranks)
    per_rank, per_expert, in_rank = reference_layout(idx, num_experts, num_ranks)
    assert torch.equal(lay.num_tokens_per_rank.long(), per_rank)
    assert torch.equal(lay.num_tokens_per_expert.long(), per_expert)
    assert torch.equal(lay.is_token_in_rank, in_rank)
    assert int(lay.num_bad_ids) == 0


@settings(max_examples=150, deadline=None)
@given(routings(), st.integers(40, 64))
def test_send_plan_orders_by_destination_then_token(case, max_tokens):
    idx, num_experts, num_ranks = case
    lay = dispatch_layout(idx, num_experts, num_ranks)
    in_rank = lay.is_token_in_rank
    rows, words = plan(in_rank, idx, lay.num_tokens_per_rank, lay.num_tokens_per_expert, max_tokens)
    for d in range(num_ranks):
        tokens = [t for t in range(idx.shape[0]) if in_rank[t, d]]
        for pos, t in enumerate(tokens):
            assert int(rows[t, d]) == d * max_tokens + pos
        assert all(int(rows[t, d]) == -1 for t in range(idx.shape[0]) if not in_rank[t, d])
        assert int(words[d]) == len(tokens)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=24), st.integers(1, 4))
def test_ids_out_of_range_are_counted_and_routed_nowhere(values, num_ranks):
    num_experts = 4 * num_ranks
    idx = torch.tensor(values, dtype=torch.int64).view(-1, 1)
    lay = dispatch_layout(idx, num_experts, num_ranks)
    bad = sum(1 for v in values if v < -1 or v >= num_experts)
    assert int(lay.num_bad_ids) == bad
    good = [v for v in values if 0 <= v < num_experts]
    assert int(lay.num_tokens_per_expert.sum()) == len(good)


def test_size_hint_matches_the_buffer_region_and_refuses_other_dtypes():
    import pytest

    from warmlink.ep import size_hint
    from warmlink.ep.wire.regions import RegionLayout
    from warmlink.errors import ConfigError

    nbytes = size_hint(4096, 7168, torch.bfloat16, num_ranks=4)
    assert nbytes == RegionLayout(4, 4096, 7168, 8).nbytes
    assert 1.10 * 2**30 < nbytes < 1.12 * 2**30  # the figure the docstring quotes
    assert size_hint(4096, 7168, torch.float8_e4m3fn, num_ranks=4) == nbytes
    with pytest.raises(ConfigError, match="dtype"):
        size_hint(4096, 7168, torch.float32, num_ranks=4)
    with pytest.raises(ConfigError, match="hidden"):
        size_hint(4096, 100, num_ranks=4)
