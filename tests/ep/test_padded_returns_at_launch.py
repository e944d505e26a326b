"""A padded SM dispatch returns at launch (ep.protocol.normal, Note [Padded dispatch returns at launch]):
its handle is pending until the Buffer's next call resolves it, the counts then equal an
unpadded dispatch's, and a refused round raises at that call and at every use of the handle.

The sender runs for rank 0 of two, with the mailboxes in this process and a mover that stands in
for the device: ``send_sm`` "copies" a board prepared by the test, ``wait_board`` returns it.
The device half (the exchange, the board's copy, the unpack) runs in the GPU tests and, for the
unpack, in Triton's interpreter (interpreted_kernels.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from warmlink.ep.kernels import steps as _kernels
from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.kernels.layout import dispatch_layout
from warmlink.ep.paths.senders import FreshSend, SmPath
from warmlink.ep.protocol.checks import Checks
from warmlink.ep.protocol.normal import NormalMode
from warmlink.ep.protocol.rounds import Rounds
from warmlink.ep.wire import mailbox as _mailbox
from warmlink.ep.wire.regions import RegionLayout, board_words
from warmlink.ep.wire.words import encode_call
from warmlink.errors import ConfigError

RANKS, EXPERTS, MAX_TOKENS, ROUND = 2, 4, 8, 1


class _DeviceStandIn:
    """The parts of ``CudaMover`` an SM sender's fresh dispatch uses, recording the host waits."""

    def __init__(self, words: np.ndarray, board: np.ndarray) -> None:
        self.words, self.board = words, board
        self.waits: list[int] = []
        self.aborted: list[int] = []

    def board_like(self) -> torch.Tensor:
        return torch.full(self.board.shape, -1, dtype=torch.int64)

    def send_sm(self, shape, call, round_, phase, timeout_s, graphs, board_copy=None) -> None:
        if board_copy is not None:  # the device's copy of the board, queued before the event
            board_copy.copy_(torch.from_numpy(self.board))

    def wait_board(self, round_: int, timeout_s: float, check=None):
        self.waits.append(round_)
        check()
        return self.words.copy(), self.board.copy()

    def abort_exchange(self, round_: int) -> None:
        self.aborted.append(round_)


def _rank0(valid: int = 1, num_worst_tokens: int = 16):
    """``(sender, call, device)``: rank 0's sender about to send round ``ROUND``, whose peer
    published the same config; the board holds both ranks' counts (rank 1's input ``valid``)."""
    gen = torch.Generator().manual_seed(3)
    topks = [torch.randint(-1, EXPERTS, (6, 2), generator=gen) for _ in range(RANKS)]
    layouts = [dispatch_layout(t, EXPERTS, RANKS) for t in topks]
    owns = [torch.zeros(_mailbox.mailbox_nbytes(RANKS), dtype=torch.uint8) for _ in range(RANKS)]
    with pytest.MonkeyPatch.context() as mp:  # (the mailbox's own CPU check is tested in test_mailbox)
        mp.setattr(_mailbox.platform, "machine", lambda: "x86_64")
        box = _mailbox.Mailbox(owns[0], 0, RANKS)
        peer = _mailbox.Mailbox(owns[1], 1, RANKS)
    box.attach(1, owns[1], peer_ref=None)
    x = torch.zeros(6, 16, dtype=torch.bfloat16)
    config = encode_call(EXPERTS, 2, x.dtype, False, True, num_worst_tokens)
    peer.publish_dispatch(ROUND, config)
    lay = RegionLayout(RANKS, MAX_TOKENS, 16, 2)
    rounds = Rounds(box, 0, RANKS, MAX_TOKENS, timeout_s=1.0)
    lay0 = layouts[0]
    words = _kernels.plan(lay0.is_token_in_rank, topks[0], lay0.num_tokens_per_rank, lay0.num_tokens_per_expert,
                          MAX_TOKENS)[1].numpy()
    board = np.zeros((RANKS, board_words(RANKS)), dtype=np.int64)
    for s, ls in enumerate(layouts):
        board[s, :2] = ROUND, (valid if s else 1)
        board[s, 2:2 + RANKS] = ls.num_tokens_per_rank.numpy()
        board[s, 2 + RANKS:2 + RANKS + EXPERTS // RANKS] = ls.num_tokens_per_expert[:EXPERTS // RANKS].numpy()
    device = _DeviceStandIn(words, board)
    sender = NormalMode(rounds, SmPath(device, lay, 0, RANKS, False), None, device, Checks(lay, RANKS, -1), lay, -1, None)
    call = FreshSend(Sources(x.view(torch.int64), topks[0]), lay0.is_token_in_rank, lay0.num_tokens_per_rank,
                     lay0.num_tokens_per_expert, EXPERTS, config, num_worst_tokens, ROUND, "dispatch.1",
                     ("recv_x.1", "recv_meta.1"))
    return sender, call, device


def test_a_padded_dispatch_returns_before_its_board_and_the_next_call_fills_its_counts_in():
    sender, call, device = _rank0()
    handle = sender.send_fresh(call, {}, hook=False)
    assert device.waits == [] and handle.pending is not None and handle.send_counts is None
    assert torch.equal(handle.board, torch.from_numpy(device.board))  # what the unpack reads on the device
    sender.resolve()  # what the Buffer's next call does first
    assert device.waits == [ROUND] and handle.pending is None
    sender.resolve()
    handle.resolve()
    assert device.waits == [ROUND], "a handle is resolved once"

    unpadded, call0, device0 = _rank0(num_worst_tokens=0)
    want = unpadded.send_fresh(call0, {}, hook=False)
    assert device0.waits == [ROUND], "an unpadded dispatch waits for its board before it returns"
    for name in ("send_counts", "recv_counts", "recv_starts", "dst_rows", "count_matrix"):
        assert getattr(handle, name) == getattr(want, name), name


def test_a_refused_padded_round_raises_at_the_next_call_and_at_every_use_of_its_handle():
    sender, call, device = _rank0(valid=0)
    handle = sender.send_fresh(call, {}, hook=False)  # returns: nothing waits for the board
    with pytest.raises(ConfigError, match=r"ranks \[1\] refused their dispatch input"):
        sender.resolve()
    sender.resolve()  # raised once by the Buffer; the next call goes on
    for _ in range(2):
        with pytest.raises(ConfigError, match="refused"):
            handle.resolve()
    assert sender.rounds.last["dispatch"] == ROUND, "the refused round is spent"


def test_closing_with_a_pending_dispatch_ends_its_exchange_without_waiting():
    sender, call, device = _rank0()
    sender.send_fresh(call, {}, hook=False)
    sender.abandon()
    assert device.aborted == [ROUND] and device.waits == []
    sender.resolve()
    assert device.waits == [], "an abandoned dispatch is not waited for"


def test_an_interrupted_resolve_leaves_a_handle_that_refuses_every_use():
    sender, call, device = _rank0()
    handle = sender.send_fresh(call, {}, hook=False)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    device.wait_board = interrupted
    with pytest.raises(KeyboardInterrupt):
        sender.resolve()
    with pytest.raises(ConfigError, match=r"round 1 never reached the host \(KeyboardInterrupt while waiting\)"):
        handle.resolve()
