"""The combine's parts (ep._reduce, Note [Pipelined combine]): the sender's split and the source's
rule agree on every row, with no word on the wire."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from warmlink.ep import _reduce


@given(count=st.integers(0, 5000), parts=st.integers(1, 16))
def test_part_bounds_cover_the_rows_once_in_the_part_the_source_computes(count, parts):
    bounds = _reduce.part_bounds(count, parts)
    assert bounds[0] == 0 and bounds[-1] == count and len(bounds) == parts + 1
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    for p in range(count):
        k = p * parts // count
        assert bounds[k] <= p < bounds[k + 1]


def test_the_last_part_is_the_combine_phase_and_the_others_have_their_own():
    names = [_reduce.part_phase(k, 1) for k in range(_reduce.PARTS)]
    assert names[-1] == "combine.1"
    assert len(set(names)) == _reduce.PARTS and all(n.endswith(".1") for n in names)


def test_parts_need_the_counts():
    rows = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="counts"):
        _reduce.combine_sum(torch.zeros(2, 8), rows, torch.empty(2, 8), parts=2)
