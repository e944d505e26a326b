"""``TargetAddresses``: a direct install's key for where its targets live (refit._addresses).

Both ways of asking: torch's C++ check (CUDA builds of torch) and the Python walk (CPU builds).
"""

from __future__ import annotations

import pytest
import torch

from warmlink.refit import _addresses
from warmlink.refit._addresses import TargetAddresses

HAS_TORCH_CHECK = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None) is not None


@pytest.fixture(params=["torch", "python"])
def way(request, monkeypatch):
    if request.param == "torch" and not HAS_TORCH_CHECK:
        pytest.skip("this build of torch has no _tensors_data_ptrs_at_indices_equal (CPU-only builds)")
    if request.param == "python":
        monkeypatch.setattr(_addresses, "_same_pointers", lambda: None)
    return request.param


def test_the_key_holds_while_nothing_moves_and_changes_when_one_target_moves(way) -> None:
    params = [torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False) for _ in range(5)]
    addresses = TargetAddresses(params)
    first = addresses.current_key()
    params[0].add_(1)  # in place: the memory stays
    assert addresses.current_key() == first
    old = params[3].data
    params[3].data = torch.zeros(4, 4)
    moved = addresses.current_key()
    assert moved != first and addresses.current_key() == moved
    params[3].data = old  # back where it was: a new key all the same, never an old one
    assert addresses.current_key() not in (first, moved)


def test_views_are_told_apart_by_their_offset(way) -> None:
    base = torch.zeros(8)
    target = base[:4]
    addresses = TargetAddresses([target])
    key = addresses.current_key()
    target.set_(base.untyped_storage(), 4, (4,), (1,))  # same storage, four elements on
    assert addresses.current_key() != key


def test_two_receivers_never_share_a_key() -> None:
    t = torch.zeros(3)
    assert TargetAddresses([t]).current_key() != TargetAddresses([t]).current_key()
