"""``ep.wire.mailbox``: the host handshake refuses CPUs whose memory order it does not handle, keeps
counts until every peer read them, and vouches only for config words still of their round."""

from __future__ import annotations

import multiprocessing
from multiprocessing import shared_memory

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from warmlink.ep.wire import mailbox as _mailbox
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


def _pair(monkeypatch):
    """Rank 0's Rounds over two mailboxes (rank 1's written directly, as its process would)."""
    from warmlink.ep.protocol.rounds import Rounds

    monkeypatch.setattr(_mailbox.platform, "machine", lambda: "x86_64")
    segment = _own(2)
    mine, theirs = _mailbox.Mailbox(_own(2), 0, 2), _mailbox.Mailbox(segment, 1, 2)
    mine.attach(1, segment, None)
    return Rounds(mine, 0, 2, 4, 1.0), theirs


@pytest.mark.parametrize("late", [False, True])
def test_without_a_host_wait_a_peers_other_combine_handle_is_refused_now_or_at_the_next_call(monkeypatch, late):
    """With arrival flags (ep.wire.flags) the receive phase does not wait for the peers: it checks the
    ones that published, and the next call checks the rest (Rounds.check_published / check_late)."""
    from warmlink.ep.wire.words import encode_combine
    from warmlink.errors import ConfigError

    rounds, theirs = _pair(monkeypatch)
    rounds.mailbox.publish_combine(3, encode_combine(2, torch.bfloat16, 0))
    other = encode_combine(1, torch.bfloat16, 0)  # rank 1 combines with an older dispatch's handle
    if not late:
        theirs.publish_combine(3, other)
        with pytest.raises(ConfigError, match="rank 1 combines with the handle of dispatch round 1"):
            rounds.check_published(_mailbox.COMBINE, 3)
        return
    rounds.check_published(_mailbox.COMBINE, 3)  # rank 1 is not there yet: nothing to check, no wait
    rounds.check_late()
    assert [(f, r, ranks) for f, r, _, ranks in rounds.late] == [(_mailbox.COMBINE, 3, [1])]
    theirs.publish_combine(3, other)
    with pytest.raises(ConfigError, match="dispatch round 1"):
        rounds.check_late()
    assert rounds.late == []


def test_a_peer_that_published_the_same_call_passes_the_late_check(monkeypatch):
    from warmlink.ep.wire.words import encode_combine

    rounds, theirs = _pair(monkeypatch)
    word = encode_combine(2, torch.bfloat16, 0)
    rounds.mailbox.publish_combine(3, word)
    rounds.check_published(_mailbox.COMBINE, 3)
    theirs.publish_combine(3, word)
    rounds.check_late()
    assert rounds.late == []


def test_a_peer_one_round_on_is_still_compared_and_two_rounds_on_breaks_the_protocol(monkeypatch):
    """Rank 1 moved one combine on: its word of round 3 is still there and is compared. Two on, it
    would have replaced it, which the round protocol never lets it do (``wait_readers``): the check
    raises ``MetadataError`` instead of taking an unread word as agreeing."""
    from warmlink.ep.wire.words import encode_combine
    from warmlink.errors import ConfigError, MetadataError

    rounds, theirs = _pair(monkeypatch)
    rounds.mailbox.publish_combine(3, encode_combine(2, torch.bfloat16, 0))
    rounds.check_published(_mailbox.COMBINE, 3)
    theirs.publish_combine(3, encode_combine(1, torch.bfloat16, 0))
    theirs.publish_combine(4, encode_combine(3, torch.bfloat16, 0))
    with pytest.raises(ConfigError, match="dispatch round 1"):
        rounds.check_late()
    theirs.publish_combine(5, encode_combine(4, torch.bfloat16, 0))
    with pytest.raises(MetadataError, match="rank 1 replaced its combine word of round 3"):
        rounds.check_published(_mailbox.COMBINE, 3)


def test_a_meet_refuses_a_word_a_peers_later_round_replaced(monkeypatch):
    """A peer one round on still has its word of the round, which is compared; a peer whose word
    of the round a later round replaced broke the round protocol: ``MetadataError``, not a pass."""
    from warmlink.ep.wire.words import encode_call
    from warmlink.errors import ConfigError, MetadataError

    rounds, theirs = _pair(monkeypatch)
    fresh = encode_call(16, 4, torch.bfloat16, False, True, 64, True)
    cached = encode_call(16, 0, torch.bfloat16, True, num_worst_tokens=64)
    rounds.mailbox.publish_dispatch(3, fresh)
    for round_, config in ((3, fresh), (4, fresh), (5, cached)):
        theirs.publish_dispatch(round_, config)
    assert theirs.config_of(1, 3) is None and theirs.config_of(1, 5) == cached
    with pytest.raises(MetadataError, match="rank 1 replaced its dispatch word of round 3"):
        rounds.meet(_mailbox.DISPATCH, 3)
    rounds.mailbox.publish_dispatch(7, fresh)
    theirs.publish_dispatch(7, cached)
    theirs.publish_dispatch(8, fresh)  # one round on: round 7's word is still there
    with pytest.raises(ConfigError, match="rank 1 dispatches with"):
        rounds.meet(_mailbox.DISPATCH, 7)


def _both(monkeypatch):
    """Ranks 0 and 1, each with its Rounds over the two mailboxes (as their processes would hold)."""
    from warmlink.ep.protocol.rounds import Rounds

    monkeypatch.setattr(_mailbox.platform, "machine", lambda: "x86_64")
    segments = [_own(2), _own(2)]
    boxes = [_mailbox.Mailbox(segments[r], r, 2) for r in range(2)]
    for r in range(2):
        boxes[r].attach(1 - r, segments[1 - r], None)
    return [Rounds(boxes[r], r, 2, 4, 0.05) for r in range(2)]


@pytest.mark.parametrize("field", [_mailbox.DISPATCH, _mailbox.COMBINE], ids=["dispatch", "combine"])
def test_a_peer_that_refused_a_round_cannot_replace_its_word_before_this_rank_checked_it(monkeypatch, field):
    """Rank 1 called round 3 with another config than rank 0, raised, and calls on with calls that
    meet no one (cached dispatches, combines): it may publish round 4, but not round 5, which would
    replace its word of round 3, before rank 0 published round 4; rank 0 still sees the word and
    raises. Without the bound rank 0 skipped the replaced word and kept round 3's rows, sent under
    another config, with no error."""
    from warmlink.ep.wire.words import encode_call, encode_combine
    from warmlink.errors import ConfigError, TransferTimeout

    zero, one = _both(monkeypatch)
    if field == _mailbox.DISPATCH:
        words = [encode_call(16, 4, torch.bfloat16, False, True, 64), encode_call(16, 4, torch.float16, False, True, 64)]

        def publish(rounds, round_, word):
            rounds.wait_readers(round_)
            rounds.mailbox.publish_dispatch(round_, word)
    else:
        words = [encode_combine(2, torch.bfloat16, 0), encode_combine(2, torch.float16, 0)]

        def publish(rounds, round_, word):
            rounds.wait_readers(round_, _mailbox.COMBINE)
            rounds.mailbox.publish_combine(round_, word)
    for round_ in (1, 2):
        publish(zero, round_, words[0])
        publish(one, round_, words[0])
    publish(zero, 3, words[0])
    publish(one, 3, words[1])
    with pytest.raises(ConfigError):
        one.check_published(field, 3)
    publish(one, 4, words[1])  # rank 0 published round 3: one round on is allowed
    with pytest.raises(TransferTimeout, match="rank"):
        publish(one, 5, words[1])  # would replace round 3's word, which rank 0 has not checked
    with pytest.raises(ConfigError):
        zero.check_published(field, 3)


def test_a_late_peers_word_is_checked_before_this_rank_publishes_its_next_round(monkeypatch):
    """A peer not at the round when this rank checked it is checked again before this rank
    publishes its next round (``wait_readers``), while its word is sure to be the round's."""
    from warmlink.ep.wire.words import encode_combine
    from warmlink.errors import ConfigError

    zero, one = _both(monkeypatch)
    zero.mailbox.publish_combine(1, encode_combine(0, torch.bfloat16, 0))
    zero.check_published(_mailbox.COMBINE, 1)  # rank 1 is not there yet
    assert [(f, r, ranks) for f, r, _, ranks in zero.late] == [(_mailbox.COMBINE, 1, [1])]
    one.mailbox.publish_combine(1, encode_combine(0, torch.float16, 0))
    with pytest.raises(ConfigError, match="rank 1 combines with"):
        zero.wait_readers(2, _mailbox.COMBINE)


def test_a_config_word_being_replaced_is_not_vouched_for(monkeypatch):
    """The writer clears the parity's tag before it stores the next word: a reader that reads the
    word in between sees no tag and takes no word."""
    monkeypatch.setattr(_mailbox.platform, "machine", lambda: "x86_64")
    box = _mailbox.Mailbox(_own(2), 0, 2)
    box.publish_dispatch(3, 111)
    assert box.config_of(0, 3) == 111 and box.config_of(0, 1) is None
    box._own[box._tag(5)] = 0  # round 5's publish has begun: the tag is cleared, the word not yet stored
    assert box.config_of(0, 3) is None


def test_a_fresh_dispatch_publishes_its_counts_only_once_every_peer_read_the_ones_they_replace(monkeypatch):
    """The counts of round n replace round n - 2's (Note [Mailbox rounds]): a rank publishes them
    once every peer published round n - 1, after reading round n - 2's; a peer stuck before that
    makes it wait, with a deadline, instead of overwriting them."""
    from warmlink.errors import TransferTimeout

    rounds, theirs = _pair(monkeypatch)
    rounds.timeout_s = 0.05
    rounds.wait_readers(1)  # the first round waits for no one
    with pytest.raises(TransferTimeout, match="rank"):
        rounds.wait_readers(2)
    theirs.publish_dispatch(3, 0)
    rounds.wait_readers(4)
    with pytest.raises(TransferTimeout, match="rank"):
        rounds.wait_readers(5)
    theirs.publish_dispatch(4, 0)
    rounds.wait_readers(5)


def _publish_rounds(name: str, rounds: int) -> None:
    """Rank 1's process: publish dispatch rounds 1..``rounds`` into the shared segment ``name``,
    each with a config word that names its round, as fast as it can."""
    segment = shared_memory.SharedMemory(name=name)
    try:
        box = _mailbox.Mailbox(torch.frombuffer(segment.buf, dtype=torch.uint8), 1, 2)
        for round_ in range(1, rounds + 1):
            box.publish_dispatch(round_, round_ * 1000 + 7, [round_, round_], [round_] * 4)
        del box
    finally:
        segment.close()


def test_config_words_read_while_another_process_replaces_them_are_always_their_rounds():
    """A peer process publishes rounds back to back while this one reads its config words of the
    current and the previous round: every word ``config_of`` returns is of the round asked for
    (the others come back None), whatever the interleaving of the two processes' stores and loads."""
    if _mailbox.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the mailbox opens on x86 only")
    segment = shared_memory.SharedMemory(create=True, size=_mailbox.mailbox_nbytes(2))
    try:
        segment.buf[:] = bytes(segment.size)
        reader = _mailbox.Mailbox(_own(2), 0, 2)
        peer = torch.frombuffer(segment.buf, dtype=torch.uint8)
        reader.attach(1, peer, None)
        writer = multiprocessing.get_context("spawn").Process(target=_publish_rounds, args=(segment.name, 200_000))
        writer.start()
        vouched = wrong = 0
        while writer.is_alive() or vouched == 0:
            at = reader.round_of(1, _mailbox.DISPATCH)
            for round_ in (at, at - 1):
                if round_ > 0:
                    word = reader.config_of(1, round_)
                    if word is not None:
                        vouched += 1
                        wrong += word != round_ * 1000 + 7
            if not writer.is_alive() and reader.round_of(1, _mailbox.DISPATCH) == 0:
                break  # the writer died before its first round: the exit code below says so
        writer.join(timeout=60)
        assert writer.exitcode == 0
        assert wrong == 0 and vouched > 0
        del reader, peer
    finally:
        segment.close()
        segment.unlink()


def test_a_staged_fresh_dispatch_waits_for_the_readers_before_it_publishes_its_counts():
    """The staged fresh dispatch (host and copy-engine paths) publishes its counts only after
    ``Rounds.wait_readers``, then meets: the order Note [Mailbox rounds] relies on."""
    from types import SimpleNamespace

    from warmlink.ep.kernels.call_block import Sources
    from warmlink.ep.protocol.checks import Checks
    from warmlink.ep.kernels.steps import plan
    from warmlink.ep.wire.regions import RegionLayout
    from warmlink.ep.paths.senders import FreshSend, HostPath
    from warmlink.ep.protocol.normal import NormalMode

    log = []
    layout = RegionLayout(2, 4, 16, 2)
    in_rank = torch.tensor([[True, True], [True, False]])
    topk = torch.tensor([[0, 2], [1, -1]])
    per_rank, per_expert = torch.tensor([2, 1]), torch.tensor([1, 1, 1, 0])
    words = plan(in_rank, topk, per_rank, per_expert, layout.max_tokens)[1].numpy()
    mover = SimpleNamespace(start_to_host=lambda w: None, begin=lambda: None, gather=lambda *a: None,
                            wait_host=lambda timeout_s: words, flush_all=lambda *a: None, place_local=lambda *a: None,
                            flush=lambda *a: None)
    mailbox = SimpleNamespace(publish_dispatch=lambda round_, config, *counts: log.append(("publish", round_)))
    rounds = SimpleNamespace(rank=0, num_ranks=2, timeout_s=1.0, mailbox=mailbox, order=lambda: [1],
                             wait_readers=lambda round_: log.append(("wait_readers", round_)),
                             meet=lambda field, round_: log.append(("meet", round_)),
                             complete_plan=lambda handle, round_: handle.__dict__.update(
                                 dst_rows=[0, 0], combine_rows=torch.zeros(2, 2, dtype=torch.int64), send_counts=[2, 1]),
                             end=lambda *a: None)
    normal = NormalMode(rounds, HostPath(mover, layout, 0, 2, False), None, mover, Checks(layout, 2, -1), layout, -1, None)
    x = torch.zeros(2, 2, dtype=torch.int64)
    call = FreshSend(Sources(x, topk), in_rank, per_rank, per_expert, 4, 0, 0, 7, "dispatch.1", ("recv_x.1", "recv_meta.1"))
    normal.send_fresh(call, {}, False)
    assert log == [("wait_readers", 7), ("publish", 7), ("meet", 7)]


@settings(max_examples=200, deadline=None)
@given(configs=st.lists(st.sampled_from([11, 22]), min_size=1, max_size=12), back=st.integers(0, 4), mine=st.sampled_from([11, 22]))
def test_a_meet_compares_a_peers_word_exactly_while_it_is_still_the_rounds(configs, back, mine):
    """A peer published dispatch rounds 1..p (``configs``); this rank meets round r <= p with its
    own word. The meet refuses exactly when the peer's word of round r differs and is still there
    (the peer at r or r + 1); a word that round r + 2 or later replaced, which the round protocol
    never lets a peer do, raises ``MetadataError``."""
    from warmlink.ep.wire.words import encode_call
    from warmlink.errors import ConfigError, MetadataError

    words = {11: encode_call(16, 4, torch.bfloat16, False, True), 22: encode_call(16, 0, torch.bfloat16, True)}
    with pytest.MonkeyPatch.context() as mp:
        rounds, theirs = _pair(mp)
    p = len(configs)
    r = max(1, p - back)
    for round_, config in enumerate(configs, 1):
        theirs.publish_dispatch(round_, words[config])
    rounds.mailbox.publish_dispatch(r, words[mine])
    if p - r > 1:
        with pytest.raises(MetadataError, match="replaced its dispatch word"):
            rounds.meet(_mailbox.DISPATCH, r)
    elif configs[r - 1] != mine:
        with pytest.raises(ConfigError, match="rank 1 dispatches with"):
            rounds.meet(_mailbox.DISPATCH, r)
    else:
        rounds.meet(_mailbox.DISPATCH, r)
