"""The receive work on its own stream (Note [Receive work on its own stream] in ep.paths.cuda_mover) and
the arrival flags (ep.wire.flags, Note [Arrival flags]), with a fake CUDA: the work waits on the device
for the sources' flags and the host returns at launch; a stalled or dead source fails the Buffer at
its next call, and every word this rank waits on is released, so no stream stays blocked."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from warmlink.ep.kernels import launch as _launch
from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.paths import cuda_mover as _cuda_mover
from warmlink.ep.paths import host_mover as _movers
from warmlink.ep.paths import sm_pushes as _sm_pushes
from warmlink.ep.protocol.normal import NormalMode
from warmlink.ep.wire import flags as _flags
from warmlink.ep.wire.flags import RELEASE, ArrivalFlags, arrival_value
from warmlink.ep.wire.regions import RegionLayout
from warmlink.errors import PeerLostError, TransferTimeout
from warmlink.transport.cuda_ipc import CopyEngines

CALLER, COPY, SIDE, COMM = 11, 12, 13, 15  # stream handles
SEND_EVENTS = [100, 101]
LOCAL = [302, 303, 304]  # counted, send_done, received
SEND_DONE, RECEIVED = LOCAL[-2], LOCAL[-1]
ORDER, JOIN = 305, 306  # the copy engines' events (transport._copy_engines)
PEER_COPY = 14  # rank 1's copy stream, with a stream per destination
OWN_FLAGS, PEER_FLAGS = 0x10000, 0x20000  # device addresses of rank 0's and rank 1's flag words


class FakeCuda:
    """Records stream waits (on events and on flag words), event records, flag stores and queries."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def event_record(self, event, stream):
        self.calls.append(("record", event, stream))

    def stream_wait_event(self, stream, event):
        self.calls.append(("wait", stream, event))

    def stream_wait_value(self, stream, address, value):
        self.calls.append(("wait value", stream, address, value))

    def stream_write_value(self, stream, address, value):
        self.calls.append(("write value", stream, address, value))

    def event_query(self, event):
        self.calls.append(("query", event))
        return True


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.cuda_stream = handle

    def torch_stream(self):
        return self


class Ref:
    def __init__(self, alive: bool = True) -> None:
        self.pid = 4242
        self._alive = alive

    def alive(self) -> bool:
        return self._alive


def _flags_of(fake, timeout_s: float = 5.0, alive: bool = True, num_ranks: int = 2):
    words = _flags.flags_nbytes(num_ranks) // 8
    own, peer = np.zeros(words, dtype=np.int64), np.zeros(words, dtype=np.int64)
    flags = ArrivalFlags(fake, own, OWN_FLAGS, 0, num_ranks, timeout_s, {1: Ref(alive)})
    flags.attach(1, peer, PEER_FLAGS)
    return flags, own, peer


def _mover(monkeypatch, fake: FakeCuda, alive: bool = True, timeout_s: float = 5.0,
           copy_streams=(COPY,)) -> _cuda_mover.CudaMover:
    assert len(LOCAL) == _cuda_mover.CudaMover.LOCAL_EVENTS  # what Buffer leases for it
    layout = RegionLayout(2, 4, 128, 2)
    flags = _flags_of(fake, timeout_s, alive)[0]
    mover = _cuda_mover.CudaMover(layout, 0, 0, torch.zeros(layout.nbytes, dtype=torch.uint8), {1: 0},
                                  CopyEngines([FakeStream(h) for h in copy_streams], ORDER, [JOIN] * (len(copy_streams) - 1),
                                              batched=True, cuda=fake),
                                  FakeStream(SIDE), LOCAL,
                                  {"dispatch.0": SEND_EVENTS, "combine.0": SEND_EVENTS,
                                   "combine_part0.0": SEND_EVENTS}, flags, {1: Ref(alive)})
    mover._cuda = fake
    monkeypatch.setattr(_cuda_mover, "current_stream", lambda device: CALLER)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "_set_stream", None)  # (on a CUDA machine on_stream would set the fake streams)
    return mover


def _own_word(flags, kind: int, op: str, rank: int) -> int:
    return OWN_FLAGS + flags._index(kind, op, rank) * 8


def test_receive_work_waits_for_the_flags_on_the_device_and_the_host_returns_at_launch(monkeypatch):
    fake = FakeCuda()
    mover = _mover(monkeypatch, fake)
    mover.start_round("dispatch", 3)
    fake.calls.clear()
    ran = []
    mover.arrived(range(2), "dispatch.0", then=lambda: ran.append(len(fake.calls)))
    calls = fake.calls
    assert not [c for c in calls if c[0] == "query"]  # no host poll of anything
    arrived = _own_word(mover.flags, 0, "dispatch", 1)
    assert ran == [2]  # launched right after its two waits
    assert calls[:2] == [("wait", SIDE, SEND_DONE), ("wait value", SIDE, arrived, arrival_value(3))]
    assert calls[2] == ("record", RECEIVED, SIDE)
    assert [c[2] for c in calls if c[:2] == ("wait", CALLER)] == [*SEND_EVENTS, RECEIVED]
    assert mover.flags.pending()


def test_each_early_part_waits_for_its_own_part_and_the_sum_frees_the_combine_area(monkeypatch):
    """The combine's parts (ep.kernels.reduce, Note [Pipelined combine]): each part's sum follows the
    source's flag of that part; the last part's value covers every part; after the sum the peers
    learn that this rank's combine area of the round is free."""
    fake = FakeCuda()
    mover = _mover(monkeypatch, fake)
    mover.start_round("combine", 5)
    ran = []
    mover.arrived(range(2), "combine.0", then=lambda: ran.append(("last", len(fake.calls))),
                  early=[("combine_part0.0", lambda: ran.append(("part0", len(fake.calls))))])
    arrived = _own_word(mover.flags, 0, "combine", 1)
    waits = [c for c in fake.calls if c[0] == "wait value"]
    assert waits == [("wait value", SIDE, arrived, arrival_value(5, 0)), ("wait value", SIDE, arrived, arrival_value(5, 3))]
    assert ran == [("part0", 2), ("last", 3)]
    freed_at_peer = PEER_FLAGS + mover.flags._index(1, "combine", 0) * 8
    assert ("write value", SIDE, freed_at_peer, 5) in fake.calls


def test_sends_signal_each_destination_and_cached_rounds_wait_for_the_peers_to_free_their_areas(monkeypatch):
    fake = FakeCuda()
    mover = _mover(monkeypatch, fake)
    mover.start_round("dispatch", 1)
    assert not [c for c in fake.calls if c[0] == "write value"]  # round 1 frees nothing
    mover.gate("dispatch", 2, sm=True)
    assert not fake.calls  # rounds 1 and 2 use fresh areas
    mover.start_round("dispatch", 4)
    freed_at_peer = PEER_FLAGS + mover.flags._index(1, "dispatch", 0) * 8
    assert fake.calls[-1] == ("write value", CALLER, freed_at_peer, 3)
    mover.gate("dispatch", 4, sm=False)
    assert fake.calls[-1] == ("wait value", COPY, _own_word(mover.flags, 1, "dispatch", 1), 2)
    mover.sent(1, "dispatch.0")
    arrived_at_peer = PEER_FLAGS + mover.flags._index(0, "dispatch", 0) * 8
    assert fake.calls[-2:] == [("record", SEND_EVENTS[1], COPY), ("write value", COPY, arrived_at_peer, arrival_value(4))]


def test_met_waits_are_dropped_and_the_host_never_blocks():
    flags, own, _ = _flags_of(FakeCuda())
    flags.wait_arrived(SIDE, "combine", range(2), arrival_value(2, 3), "combine.0 bytes")
    assert flags.pending()
    flags.check()  # not met, not late: nothing happens
    own[flags._index(0, "combine", 1)] = arrival_value(2, 3)  # what rank 1's stream stores
    flags.check()
    assert not flags.pending()


@pytest.mark.parametrize("alive, error", [(True, TransferTimeout), (False, PeerLostError)])
def test_a_late_or_dead_source_fails_the_buffer_and_releases_every_wait(alive, error):
    flags, own, peer = _flags_of(FakeCuda(), timeout_s=0.0, alive=alive)
    flags.wait_arrived(SIDE, "dispatch", range(2), arrival_value(7), "dispatch.1 bytes")
    time.sleep(0.01)
    with pytest.raises(error, match="rank"):
        flags.check()
    assert (own == RELEASE).all()  # every stream of this rank that waits on a flag goes on
    assert not peer.any()  # a rank releases only its own words
    with pytest.raises(error):  # and every later call raises too
        flags.check()


def test_the_watchdog_fails_a_wait_on_a_dead_rank_with_no_call(monkeypatch):
    """A caller that waits on its stream and never calls again: the watchdog thread probes the
    ranks and releases the stream."""
    monkeypatch.setattr(_flags, "_WATCH_PERIOD_S", 0.01)
    monkeypatch.setattr(_flags, "_WATCHDOG", _flags._Watchdog())
    flags, own, _ = _flags_of(FakeCuda(), timeout_s=60.0, alive=False)
    flags.wait_arrived(SIDE, "dispatch", range(2), arrival_value(1), "dispatch.1 bytes")
    deadline = time.monotonic() + 30.0
    while flags.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(flags.error, PeerLostError) and (own == RELEASE).all()


def test_a_failed_receive_marks_the_receive_stream_failed():
    class Failing:
        def arrived(self, *args, **kwargs):
            raise TransferTimeout("stalled")

    normal = NormalMode(SimpleNamespace(rank=0, num_ranks=2, timeout_s=0.01), None, None, Failing(), None, None, -1, None)
    with pytest.raises(TransferTimeout):
        normal._arrived("dispatch.0", lambda: None, ())
    assert normal.recv_failed  # Buffer.close then stops ordering the caller's stream after the receive stream


# -- the count exchange's host wait (ep.paths.sm_pushes, Note [SM sends]) ---------------------------------
COUNTED = LOCAL[0]


class StalledBoard(FakeCuda):
    """The board's event (``counted``) completes only after the host wrote the abort word, as the
    exchange kernel does when it sees it; ``None``: never."""

    def __init__(self, mover_box: list, abort_ends_it: bool = True) -> None:
        super().__init__()
        self.box, self.abort_ends_it = mover_box, abort_ends_it
        self.polls = 0

    def event_query(self, event):
        if event != COUNTED:
            return True
        self.polls += 1
        return self.abort_ends_it and bool(self.box[0]._abort_word[0])


@pytest.mark.parametrize("why", ["timeout", "dead peer", "check gives up"])
def test_giving_up_on_the_board_aborts_the_exchange_and_raises(monkeypatch, why):
    """wait_board raises for a stalled or dead peer, or when ``check`` refuses, and first writes
    the round into the abort word that ends the exchange kernel's wait (no kernel left spinning)."""
    box: list = []
    fake = StalledBoard(box)
    mover = _mover(monkeypatch, fake, alive=why != "dead peer")
    box.append(mover)

    def check():
        if why == "check gives up":
            raise ValueError("rank 1 called with another config")

    error = {"timeout": TransferTimeout, "dead peer": PeerLostError, "check gives up": ValueError}[why]
    with pytest.raises(error):
        mover.wait_board(7, 0.03, check)
    assert mover._abort_word[0] == 7


def test_a_board_that_arrives_is_read_without_aborting(monkeypatch):
    fake = FakeCuda()  # every event is complete: the board is in
    mover = _mover(monkeypatch, fake)
    mover._host_words = 3
    mover._host_view[:3] = [4, 5, 6]  # (where the exchange lands the plan's words: Note [Board landing])
    words, board = mover.wait_board(3, 1.0)
    assert words.tolist() == [4, 5, 6] and board.shape == (2, mover._board_row)
    assert mover._abort_word[0] == 0


def test_the_board_is_read_in_place_once_the_exchange_ended_and_not_before(monkeypatch):
    """``board_now`` (a streamed dispatch's way to its launch) waits for nothing: None while the
    board's event is pending; once it completed, the board where the exchange copies it (the same
    memory, so the next exchange's copy shows there), where ``wait_board`` hands out copies."""
    box: list = []
    stalled = StalledBoard(box, abort_ends_it=False)
    mover = _mover(monkeypatch, stalled)
    box.append(mover)
    assert mover.board_now() is None and stalled.polls == 1
    mover._cuda = FakeCuda()
    mover._board_host.copy_(torch.arange(mover._board_host.numel()))
    board = mover.board_now()
    assert board.shape == (2, mover._board_row) and board[1, 0] == mover._board_row
    mover._host_words = 1
    _, copied = mover.wait_board(3, 1.0)
    mover._board_host.fill_(-1)  # the next exchange's board
    assert (board == -1).all() and copied[1, 0] == mover._board_row


def test_waiting_for_the_callers_stream_times_out(monkeypatch):
    box: list = []
    mover = _mover(monkeypatch, StalledBoard(box, abort_ends_it=False))
    box.append(mover)
    with pytest.raises(TransferTimeout, match="count copy"):
        mover.wait_host(0.02)


class PendingOwnEvent(FakeCuda):
    """The own send event of dispatch.0 (recorded after round n - 2's push) completes after ``polls``
    queries; each query checks that the parity's call block still holds round n - 2's words."""

    def __init__(self, mover_box: list, polls: int | None) -> None:
        super().__init__()
        self.box, self.pending, self.rewritten_early = mover_box, polls, False
        self.polls = 0

    def event_query(self, event):
        if event != SEND_EVENTS[0]:
            return True
        self.rewritten_early |= int(self.box[0]._cached_words[0][_sm_pushes._TOKENS]) != 111
        self.polls += 1
        return self.pending is not None and self.polls > self.pending


@pytest.mark.parametrize("polls", [0, 3, None])
def test_a_cached_call_block_is_rewritten_only_after_the_push_that_read_it_ran(monkeypatch, polls):
    """A caller may change streams between rounds, so the host waits (bounded) for round n - 2's own
    send event before it rewrites that round's call block (ep.paths.sm_pushes, SmPushes._push_cached)."""
    box: list = []
    fake = PendingOwnEvent(box, polls)
    mover = _mover(monkeypatch, fake)
    box.append(mover)
    mover._cached_words[0][_sm_pushes._TOKENS] = 111  # what round n - 2 left there
    launched = []
    monkeypatch.setattr(mover, "_launch", lambda key, steps, graphs: launched.append(key))
    rows, x = torch.zeros(7, 2, dtype=torch.int64), torch.zeros(7, 16, dtype=torch.int64)

    def call() -> None:
        mover._push_cached(rows, Sources(x), [0] * 4, 0, 0.05, graphs=True)

    if polls is None:  # never ran: a timeout, and the block and the launches untouched
        with pytest.raises(TransferTimeout, match="call block"):
            call()
        assert int(mover._cached_words[0][_sm_pushes._TOKENS]) == 111 and not launched
    else:
        call()
        assert int(mover._cached_words[0][_sm_pushes._TOKENS]) == 7 and len(launched) == 1
        assert fake.polls == polls + 1
    assert not fake.rewritten_early


class PendingCombine(FakeCuda):
    """This rank's own final combine event of parity 0 (round n - 2's) completes after ``polls``
    queries; each query checks that the parity's counts still hold round n - 2's."""

    OWN = 150

    def __init__(self, mover_box: list, polls: int | None) -> None:
        super().__init__()
        self.box, self.pending, self.rewritten_early = mover_box, polls, False
        self.polls = 0

    def event_query(self, event):
        if event != self.OWN:
            return True
        self.rewritten_early |= self.box[0]._counts_words[0].tolist() != [9, 9]
        self.polls += 1
        return self.pending is not None and self.polls > self.pending

    def memcpy_async(self, dst, src, nbytes, stream):
        self.calls.append(("copy", dst, src, nbytes, stream))


@pytest.mark.parametrize("polls", [0, 2, None])
def test_a_combines_counts_are_rewritten_only_after_the_combine_that_read_them_sent(monkeypatch, polls):
    """The combine's per-rank counts (ep.kernels.reduce, Note [Pipelined combine]) reach the device
    through a pinned row per parity, rewritten only once round n - 2's own final event completed."""
    box: list = []
    fake = PendingCombine(box, polls)
    mover = _mover(monkeypatch, fake)
    box.append(mover)
    mover._send_events["combine.0"] = [PendingCombine.OWN, 151]
    mover._counts_words[0] = [9, 9]  # what round n - 2 left there
    if polls is None:
        with pytest.raises(TransferTimeout, match="counts"):
            mover.combine_counts([4, 5], 0, 0.03)
        assert mover._counts_words[0].tolist() == [9, 9]
        assert not [c for c in fake.calls if c[0] == "copy"]
    else:
        dev = mover.combine_counts([4, 5], 0, 1.0)
        assert mover._counts_words[0].tolist() == [4, 5] and fake.polls == polls + 1
        assert [c for c in fake.calls if c[0] == "copy"] == [
            ("copy", dev.data_ptr(), mover._counts_host[0].data_ptr(), 16, CALLER)]
    assert not fake.rewritten_early


class Copies(FakeCuda):
    def memcpy_async(self, dst, src, nbytes, stream):
        self.calls.append(("copy", dst, src, nbytes, stream))

    def memcpy_batch_async(self, dsts, srcs, sizes, stream):
        self.calls.append(("batch", list(dsts), list(srcs), list(sizes), stream))


@pytest.mark.parametrize("batch", [True, False])
def test_copy_all_is_one_batch_on_the_shared_stream_or_one_copy_each(monkeypatch, batch):
    """copy_all (the combine's parts): one cudaMemcpyBatchAsync on the copy stream every destination
    shares, or, without it, a copy per entry; empty entries move nothing either way."""
    fake = Copies()
    mover = _mover(monkeypatch, fake)
    mover._engines.batched = batch
    rows = torch.zeros(6, 16, dtype=torch.bfloat16)  # 32 bytes a row: 4 int64 words
    area = "comb_x.0"
    there = mover._ptrs[1] + mover._offsets[area]
    mover.copy_all([(1, rows[0:2], area, 5), (1, rows[2:2], area, 7), (1, rows[2:6], area, 9)])
    want = [(there + 5 * 32, rows[0:2].data_ptr(), 64), (there + 9 * 32, rows[2:6].data_ptr(), 128)]
    if batch:
        assert fake.calls == [("batch", [w[0] for w in want], [w[1] for w in want], [w[2] for w in want], COPY)]
    else:
        assert fake.calls == [("copy", *w, COPY) for w in want]


def test_flush_all_batches_the_peers_copies_then_marks_every_destination(monkeypatch):
    """flush_all (a copy-engine dispatch): the staged rows of every peer in one batch on the shared
    copy stream, then this rank's own event on the caller's stream, and each peer's event and
    arrival flag on the copy stream."""
    fake = Copies()
    mover = _mover(monkeypatch, fake)
    mover.start_round("dispatch", 1)
    x = torch.zeros(3, 16, dtype=torch.int64)  # 128 bytes a row, no meta
    src = Sources(x)
    mover.flush_all("dispatch.0", src, ("recv_x.0", "recv_meta.0"), [(1, 2, 3), (0, 0, 0)])
    slot = 1 * mover.layout.max_tokens
    staged = mover._views.parts(0, src, _movers.STAGE)[0].data_ptr() + slot * 128
    there = mover._ptrs[1] + mover._offsets["recv_x.0"] + 2 * 128
    arrived_at_peer = PEER_FLAGS + mover.flags._index(0, "dispatch", 0) * 8
    assert fake.calls == [("batch", [there], [staged], [3 * 128], COPY), ("record", SEND_EVENTS[0], CALLER),
                          ("record", SEND_EVENTS[1], COPY), ("write value", COPY, arrived_at_peer, arrival_value(1))]


def test_released_words_stay_released_until_forget(monkeypatch):
    """A slow peer (not a dead one) may store a round over RELEASE after a failure; a wait of a
    later round, queued before it, would then block again. The next sweep stores RELEASE again,
    until close's forget, after which the pages belong to the pool and nothing stores there."""
    monkeypatch.setattr(_flags, "_WATCHDOG", _flags._Watchdog())
    flags, own, _ = _flags_of(FakeCuda(), timeout_s=0.0)
    flags.wait_arrived(SIDE, "dispatch", range(2), arrival_value(7), "dispatch.1 bytes")
    time.sleep(0.01)
    with pytest.raises(TransferTimeout):
        flags.check()
    own[flags._index(0, "dispatch", 1)] = arrival_value(7)  # the slow peer's stream, late
    assert flags.pending()  # the watchdog keeps sweeping a released Buffer
    flags.sweep(liveness=True)
    assert (own == RELEASE).all()
    flags.close()
    flags.forget()
    own[:] = 0  # the pool's next Buffer zeroes the page
    flags.sweep(liveness=True)
    assert not own.any() and not flags.pending()


def test_a_stream_per_destination_copies_each_peers_rows_on_its_own_stream(monkeypatch):
    """copy_streams="per-peer": the link's copy engines hold a stream per destination; begin orders
    every one after the caller, and a peer's copies, event and arrival flag all go on its stream."""
    fake = Copies()
    mover = _mover(monkeypatch, fake, copy_streams=(COPY, PEER_COPY))
    mover.start_round("dispatch", 1)
    mover.begin()
    assert fake.calls == [("record", ORDER, CALLER), ("wait", COPY, ORDER), ("wait", PEER_COPY, ORDER)]
    fake.calls.clear()
    x = torch.zeros(3, 16, dtype=torch.int64)
    src = Sources(x)
    mover.flush_all("dispatch.0", src, ("recv_x.0", "recv_meta.0"), [(0, 0, 1), (1, 2, 3)])
    staged = mover._views.parts(0, src, _movers.STAGE)[0].data_ptr() + mover.layout.max_tokens * 128
    there = mover._ptrs[1] + mover._offsets["recv_x.0"] + 2 * 128
    arrived_at_peer = PEER_FLAGS + mover.flags._index(0, "dispatch", 0) * 8
    assert fake.calls == [("record", SEND_EVENTS[0], CALLER), ("batch", [there], [staged], [3 * 128], PEER_COPY),
                          ("record", SEND_EVENTS[1], PEER_COPY),
                          ("write value", PEER_COPY, arrived_at_peer, arrival_value(1))]


def test_a_call_on_another_stream_than_the_last_send_first_waits_for_that_send(monkeypatch):
    """Calls of one Buffer keep their issue order on the device (Note [Communication stream]): a
    fresh SM send's kernels read the mover's call block when they run, so a call on the caller's
    stream after an async one (on the communication stream) must not run ahead of its push."""
    fake = FakeCuda()
    mover = _mover(monkeypatch, fake)
    current = [CALLER]
    monkeypatch.setattr(_cuda_mover, "current_stream", lambda device: current[0])
    for round_ in (1, 2):  # the first call waits for nothing, and a call on the last one's stream neither
        mover.start_round("dispatch", round_)
        mover.send_done()
    assert not [c for c in fake.calls if c[0] == "wait"]
    current[0] = COMM
    fake.calls.clear()
    mover.start_round("dispatch", 3)  # an async call: after the caller's last send
    assert fake.calls[0] == ("wait", COMM, SEND_DONE)
    mover.send_done()
    assert fake.calls[-1] == ("record", SEND_DONE, COMM)
    current[0] = CALLER
    fake.calls.clear()
    mover.start_round("combine", 1)  # back on the caller's stream: after the async send
    assert fake.calls == [("wait", CALLER, SEND_DONE)]
