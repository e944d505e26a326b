"""The combine's parts (ep.kernels.reduce, Note [Pipelined combine]): the sender's split and the source's
rule agree on every row, with no word on the wire."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from warmlink.ep.kernels import reduce as _reduce


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


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("parts", [1, 2])
def test_a_nan_or_inf_in_one_copy_leaves_every_other_token_exact(poison, parts):
    """Tokens without a copy from a rank read nothing there: a bad value in row 0 of the area (what
    an absent copy's index lands on) or of this rank's own rows stays in the token that sent it."""
    gen = torch.Generator().manual_seed(5)
    tokens, slot, hidden, me = 9, 10, 16, 1
    goes = torch.rand(tokens, 2, generator=gen) < 0.5
    goes[0] = True  # token 0 has a copy on both ranks: area row 0 and own row 0 are its
    goes[1] = False  # a token that went nowhere
    pos = goes.long().cumsum(0) - 1
    rows = torch.where(goes, pos + torch.arange(2) * slot, -1)
    area = torch.randn(2 * slot, hidden, generator=gen).to(torch.bfloat16)
    own = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    local, counts = (own, me, -me * slot), goes.sum(0)
    want = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    _reduce.combine_sum(area, rows, want, local=local, use_triton=False)
    area[0, 3], own[0, 5] = poison, poison
    got = torch.full((tokens, hidden), 7, dtype=torch.bfloat16)
    for k in range(parts):
        _reduce.combine_sum(area, rows, got, local=local, counts=counts, slot_rows=slot, part=k, parts=parts,
                            use_triton=False)
    assert torch.equal(got[1:], want[1:])
    assert not got[1].any()
    assert not torch.isfinite(got[0, 3]) and not torch.isfinite(got[0, 5])
