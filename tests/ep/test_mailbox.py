"""``ep._mailbox``: the host handshake refuses CPUs whose memory order it does not handle."""

from __future__ import annotations

import pytest
import torch

from warmlink.ep import _mailbox
from warmlink.errors import BackendUnavailable


def _own(num_ranks: int) -> torch.Tensor:
    return torch.zeros(_mailbox.mailbox_nbytes(num_ranks), dtype=torch.uint8)


def test_mailbox_refuses_a_cpu_without_x86_store_order(monkeypatch) -> None:
    monkeypatch.setattr(_mailbox.platform, "machine", lambda: "aarch64")
    with pytest.raises(BackendUnavailable, match="this host is 'aarch64'.*Note \\[Mailbox rounds\\]"):
        _mailbox.Mailbox(_own(2), 0, 2)


def test_mailbox_round_trip_on_x86(monkeypatch) -> None:
    monkeypatch.setattr(_mailbox.platform, "machine", lambda: "x86_64")
    box = _mailbox.Mailbox(_own(2), 0, 2)
    box.publish_dispatch(3, config=7, per_rank=[5, 6], per_expert=[1, 2, 3, 4])
    assert box._own[_mailbox.DISPATCH] == 3 and box.config(0, 3) == 7
    per_rank, experts = box.counts(0, 3, slice(1, 3))
    assert per_rank.tolist() == [5, 6] and experts.tolist() == [2, 3]


def test_meet_values_live_in_their_parity_word(monkeypatch) -> None:
    """A peer one meet ahead writes the other parity's word: this meet's value stays readable."""
    monkeypatch.setattr(_mailbox.platform, "machine", lambda: "x86_64")
    box = _mailbox.Mailbox(_own(2), 0, 2)
    box.publish_meet(1, 11)
    box.publish_meet(2, 22)
    assert box._own[_mailbox.MEET] == 2 and box.meet_value(0, 1) == 11 and box.meet_value(0, 2) == 22
