"""ep.wire.handle: a plan filled from the count matrix, DeepEP's per-expert list, and the refusal of a
padded round that every rank reaches alike."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from warmlink.ep.wire.handle import Handle, fill_plan, per_expert_list
from warmlink.errors import ConfigError


def _handle(send_counts: list[int], num_worst_tokens: int = 0) -> Handle:
    empty = torch.zeros(0, len(send_counts), dtype=torch.int64)
    return Handle(4, 0, empty.bool(), empty, list(send_counts), num_worst_tokens=num_worst_tokens)


matrices = st.integers(1, 6).flatmap(
    lambda r: st.lists(st.lists(st.integers(0, 50), min_size=r, max_size=r), min_size=r, max_size=r))


@given(matrices, st.integers(1, 200))
def test_every_rank_refuses_a_padded_round_alike_and_only_when_a_rank_receives_too_many(matrix, worst):
    refused = []
    for rank in range(len(matrix)):
        try:
            fill_plan(_handle(matrix[rank], worst), matrix, [0], rank)
        except ConfigError as exc:
            refused.append(str(exc))
        else:
            refused.append(None)
    too_many = max(sum(row[d] for row in matrix) for d in range(len(matrix))) > worst
    assert all((r is not None) == too_many for r in refused), refused
    assert len(set(refused)) == 1  # the same words on every rank


def test_a_plan_orders_rows_by_source_and_a_padded_one_keeps_the_exact_counts():
    matrix = [[1, 2], [3, 4]]  # matrix[s][d]: rows s sends d
    h = _handle([3, 4], num_worst_tokens=6)
    fill_plan(h, matrix, [2, 5], rank=1)
    assert (h.recv_counts, h.recv_starts, h.dst_rows, h.num_recv_tokens) == ([2, 4], [0, 2], [1, 2], 6)
    assert per_expert_list(h, 1) == []  # DeepEP's: empty for padded outputs
    assert h.num_recv_tokens_per_expert_list == [2, 5]


@pytest.mark.parametrize("align, want", [(1, [0, 5, 16]), (4, [0, 8, 16]), (16, [0, 16, 16])])
def test_per_expert_counts_round_up_to_the_alignment(align, want):
    h = _handle([0, 0])
    h.num_recv_tokens_per_expert_list = [0, 5, 16]
    assert per_expert_list(h, align) == want
