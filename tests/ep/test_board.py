"""The host half of SM sends (ep.paths.sm_pushes, Note [SM sends]): a rank's count board yields the same
handle as the copy-engine path's mailbox meeting, and refuses late, refused or impossible rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.ep.protocol.rounds import Rounds
from warmlink.ep.wire import mailbox as _mailbox
from warmlink.ep.wire.handle import Handle, plan_from_board, recv_starts
from warmlink.ep.wire.regions import RegionLayout, board_words
from warmlink.errors import ConfigError, MetadataError, TransferTimeout

ROUND = 5


def _host_side(num_ranks: int, rank: int, max_tokens: int) -> Rounds:
    """A rank's round protocol without regions or peers (its mailbox comes later): all that
    completing a plan reads."""
    rounds = Rounds(None, rank, num_ranks, max_tokens, timeout_s=1.0)
    rounds.layout = RegionLayout(num_ranks, max_tokens, 128, 2)
    return rounds


def _handle(num_experts: int, send_counts: list[int]) -> Handle:
    empty = torch.zeros(0, len(send_counts), dtype=torch.int64)
    return Handle(num_experts, 0, empty.bool(), empty, list(send_counts), num_topk=2, round=ROUND)


def _board(counts: np.ndarray, per_expert: np.ndarray, rank: int, tags=None, valid=None) -> np.ndarray:
    """Rank ``rank``'s board as its peers' exchange programs fill it."""
    num_ranks = counts.shape[0]
    epr = per_expert.shape[1] // num_ranks
    board = np.zeros((num_ranks, board_words(num_ranks)), dtype=np.int64)
    for s in range(num_ranks):
        board[s, 0] = ROUND if tags is None else tags[s]
        board[s, 1] = 1 if valid is None else valid[s]
        board[s, 2:2 + num_ranks] = counts[s]
        board[s, 2 + num_ranks:2 + num_ranks + epr] = per_expert[s, rank * epr:(rank + 1) * epr]
    return board


def _from_mailboxes(buf: Rounds, counts: np.ndarray, per_expert: np.ndarray) -> Handle:
    """The copy-engine path's plan completion, every rank having published its counts."""
    num_ranks = buf.num_ranks
    owns = [torch.zeros(_mailbox.mailbox_nbytes(num_ranks), dtype=torch.uint8) for _ in range(num_ranks)]
    with pytest.MonkeyPatch.context() as mp:  # (the mailbox's own CPU check is tested in test_mailbox)
        mp.setattr(_mailbox.platform, "machine", lambda: "x86_64")
        boxes = [_mailbox.Mailbox(own, r, num_ranks) for r, own in enumerate(owns)]
    for r, box in enumerate(boxes):
        box.publish_dispatch(ROUND, 0, counts[r].tolist(), per_expert[r].tolist())
    buf.mailbox = boxes[buf.rank]
    for r in range(num_ranks):
        if r != buf.rank:
            buf.mailbox.attach(r, owns[r], peer_ref=None)
    handle = _handle(per_expert.shape[1], counts[buf.rank].tolist())
    buf.complete_plan(handle, ROUND)
    return handle


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_board_gives_the_mailbox_meetings_handle(data):
    num_ranks = data.draw(st.integers(1, 8), label="ranks")
    rank = data.draw(st.integers(0, num_ranks - 1), label="rank")
    epr = data.draw(st.integers(1, 4), label="experts per rank")
    cap = data.draw(st.integers(1, 40), label="max tokens")
    row = st.lists(st.integers(0, cap), min_size=num_ranks, max_size=num_ranks)
    counts = np.array(data.draw(st.lists(row, min_size=num_ranks, max_size=num_ranks)), dtype=np.int64)
    counts = counts.reshape(num_ranks, num_ranks)
    per_expert = np.array(data.draw(st.lists(st.integers(0, 100), min_size=num_ranks * num_ranks * epr,
                                             max_size=num_ranks * num_ranks * epr)), dtype=np.int64)
    per_expert = per_expert.reshape(num_ranks, num_ranks * epr)
    buf = _host_side(num_ranks, rank, cap)
    want = _from_mailboxes(buf, counts, per_expert)
    got = _handle(num_ranks * epr, counts[rank].tolist())
    plan_from_board(got, _board(counts, per_expert, rank), ROUND, rank, cap)
    for name in ("recv_counts", "recv_starts", "dst_rows", "num_recv_tokens_per_expert_list"):
        assert getattr(got, name) == getattr(want, name), name
        assert all(type(v) is int for v in getattr(got, name)), name  # plain ints, as the mailbox path gives
    # the rows of this rank in d start after those of the ranks below it (Note [Send order])
    assert got.dst_rows == [int(counts[:rank, d].sum()) for d in range(num_ranks)]
    # what a streamed dispatch reads before its launch agrees with the plan filled in after it
    starts = recv_starts(_board(counts, per_expert, rank), rank, cap)
    assert starts == [*want.recv_starts, sum(want.recv_counts)] and all(type(v) is int for v in starts)


def _refusal(before_launch, num_ranks=4, rank=1, **board_kw):
    """``plan_from_board`` of a board made with ``board_kw``; ``recv_starts`` of it must raise
    ``before_launch`` (an error type) or return it (None: a refusal, nothing sent)."""
    counts = np.full((num_ranks, num_ranks), 2, dtype=np.int64)
    per_expert = np.ones((num_ranks, 2 * num_ranks), dtype=np.int64)
    buf = _host_side(num_ranks, rank, 8)
    overrides = board_kw.pop("counts", None)
    if overrides is not None:
        counts = overrides
    board = _board(counts, per_expert, rank, **board_kw)
    try:
        plan_from_board(_handle(2 * num_ranks, counts[rank].tolist()), board, ROUND, rank, buf.layout.max_tokens)
    finally:  # a streamed dispatch's read before its launch: the same timeout and corruption, None for a refusal
        try:
            starts = recv_starts(board, rank, buf.layout.max_tokens)
        except (TransferTimeout, MetadataError) as exc:
            starts = type(exc)
        assert starts is before_launch, starts


def test_a_board_without_every_rank_of_this_round_is_a_timeout():
    with pytest.raises(TransferTimeout, match=r"round 5 ended without the counts of ranks \[0, 3\]"):
        _refusal(TransferTimeout, tags=[ROUND - 2, ROUND, ROUND, 0])


def test_a_refused_input_is_named_and_nothing_was_sent():
    with pytest.raises(ConfigError, match=r"ranks \[2\] refused their dispatch input.*nothing was sent"):
        _refusal(None, valid=[1, 1, 0, 1])


def test_counts_beyond_a_slot_are_refused_as_corrupt():
    counts = np.full((4, 4), 2, dtype=np.int64)
    counts[3, 0] = 9  # more rows than max_tokens=8
    with pytest.raises(MetadataError, match="expected each count in \\[0, 8\\]"):
        _refusal(MetadataError, counts=counts)
