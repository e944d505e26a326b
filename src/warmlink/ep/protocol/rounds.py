"""The round protocol of a Buffer's dispatches and combines, over the host mailboxes (ep.wire.mailbox).

# Note [Round protocol]
A dispatch (and likewise a combine) is one round ``n`` of a handshake in the host mailboxes:

1. publish "ready for round n", with the config word and, for a fresh dispatch, the counts;
2. a fresh dispatch waits until every peer published the same (it needs their counts to know
   where its rows go, Note [Send order] in ep.kernels.layout; a peer publishes them once its stream
   reached the round, so the receive areas of round n - 2 are free); with SM sends, kernels trade
   the counts and store the rows instead, and the host meets the peers after (ep.paths.sm_pushes, Note
   [SM sends]; a padded dispatch's host at its next call: ep.protocol.normal, Note [Padded dispatch
   returns at launch]). A cached dispatch and a combine do not wait for the peers' calls of round
   n (only, as every call, for each peer to have published round n - 1: Note [Mailbox rounds] in
   ep.wire.mailbox): round n lands in the receive areas of parity n % 2 (ep.wire.regions, Note [Two
   parities]), which round n - 2 used. On the device, the arrival flags' ``freed`` words hold
   the writes until every peer is done with them (ep.wire.flags, Note [Arrival flags]); with host
   copies, this rank's host passed round n - 1's step 4, which waited for every peer's host to
   pass round n - 1's start;
3. every source issues its rows, marks them sent (on the device: arrival flags), and publishes
   "round n sent";
4. the receive phase (inline or in the hook). With host copies it checks every peer's "ready"
   word for round n (the same config, the same dispatch's handle), waits for every source's
   "round n sent", then does the receive work. On the device, the receive work waits for the
   arrival flags on the receive stream, and the host checks the "ready" words of the peers that
   published already (the others at the next call) and returns at launch.

Outputs of ``dispatch`` are views of this rank's receive area, valid until the next ``dispatch`` on
the buffer (as DeepEP's low-latency outputs are). Every wait has the buffer's timeout; a dead peer
raises ``PeerLostError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from warmlink.ep.wire import mailbox as mb
from warmlink.ep.wire.handle import Handle, fill_plan
from warmlink.ep.wire.words import REFUSED, RefusedRound, combine_handle_round, describe_call, describe_combine
from warmlink.errors import ConfigError, MetadataError

__all__ = ["Pending", "Rounds"]


@dataclass
class Pending:
    """A send phase whose receive phase has not run yet."""

    phase: str
    round: int
    done: bool = False


class Rounds:
    """One rank's side of the round protocol (Note [Round protocol]): its round numbers, the
    meetings in the mailboxes, and the checks that every peer called alike.

    Args:
        mailbox: this rank's ``Mailbox``, with its peers' attached.
        rank, num_ranks: this rank and the group size.
        max_tokens: the slot rows per source (``RegionLayout.max_tokens``).
        timeout_s: every wait's limit.
    """

    def __init__(self, mailbox: mb.Mailbox, rank: int, num_ranks: int, max_tokens: int, timeout_s: float) -> None:
        self.mailbox = mailbox
        self.rank, self.num_ranks = rank, num_ranks
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.last = {"dispatch": 0, "combine": 0}  # the last round sent, or spent on every rank
        self.pending: Pending | None = None
        self.meets = 0  # all_gather_int rounds so far
        self.late: list[tuple[int, int, int, list[int]]] = []  # (field, round, own word, ranks) to check later

    def all_gather_int(self, value: int, timeout_s: float, again: bool = False) -> list[int]:
        """Every rank's ``value`` in rank order, through the mailboxes (a peer at most one meet
        ahead writes the other parity's word, so this meet's values stay until all are read).
        ``again``: wait once more for the last meet, whose wait timed out (``value`` is not used)."""
        if not again:
            self.meets += 1
            self.mailbox.publish_meet(self.meets, value)
        self.mailbox.wait(mb.MEET, self.meets, timeout_s)
        return [self.mailbox.meet_value(r, self.meets) for r in range(self.num_ranks)]

    def wait_readers(self, round_: int, field: int = mb.DISPATCH) -> None:
        """Before this rank publishes ``field`` (``mb.DISPATCH`` or ``mb.COMBINE``) of ``round_``:
        wait until every peer published ``round_ - 1``, then check the words of the peers that were
        late (``check_late``). A peer replaces its word (and counts) of round ``n`` only when it
        publishes ``n + 2``, after this rank published ``n + 1``, so every word and count this
        rank reads is still its round's (Note [Mailbox rounds]). Ranks in step wait for nothing."""
        if round_ > 1:
            self.mailbox.wait(field, round_ - 1, self.timeout_s)
        self.check_late()

    def next(self, op: str) -> int:
        """The round number of the next ``op`` (``"dispatch"`` or ``"combine"``)."""
        return self.last[op] + 1

    def end(self, op: str, round_: int) -> None:
        """``round_`` of ``op`` is sent, or spent on every rank (a refusal every rank raised)."""
        self.last[op] = round_

    def refuse(self, op: str) -> None:
        """This rank refused its next ``op`` (``"dispatch"`` or ``"combine"``) without counts: publish
        that round ``REFUSED`` and spend it, so that each peer's meet raises naming this rank
        (ep.protocol.normal, Note [Refused dispatch])."""
        round_ = self.next(op)
        field = mb.DISPATCH if op == "dispatch" else mb.COMBINE
        self.wait_readers(round_, field)
        if op == "dispatch":
            self.mailbox.publish_dispatch(round_, REFUSED)
        else:
            self.mailbox.publish_combine(round_, REFUSED)
        self.end(op, round_)

    def check_no_pending(self, func: str) -> None:
        if self.pending is not None and not self.pending.done:
            raise ConfigError(f"ep.Buffer.{func}: the receive hook of {self.pending.phase} round "
                              f"{self.pending.round} was not called; call it before the next operation")

    def order(self) -> list[int]:
        """Peers starting after this rank: ranks start on different peers."""
        return [(self.rank + i) % self.num_ranks for i in range(1, self.num_ranks)]

    def meet(self, field: int, round_: int) -> None:
        """Wait until every peer published ``field`` (``mb.DISPATCH`` or ``mb.COMBINE``, "ready")
        for ``round_``, then check it called with the same config (dispatch) or handle (combine).
        A word a peer's later round replaced raises ``MetadataError`` (Note [Mailbox rounds])."""
        self.mailbox.wait(field, round_, self.timeout_s)
        words = {r: self._word(r, field, round_) for r in range(self.num_ranks) if r != self.rank}
        self._check_words(field, round_, self._own_word(field, round_), words)

    def before_receive(self, field: int, sent: int, round_: int, host_ordered: bool, checks: bool = True) -> None:
        """Step 4 of Note [Round protocol] before the receive work: with host copies
        (``host_ordered``) wait until every peer published ``field`` (checked, when ``checks``) and
        ``sent`` for ``round_``; with arrival flags only check the peers that published already."""
        if host_ordered:
            if checks:
                self.meet(field, round_)
            self.mailbox.wait(sent, round_, self.timeout_s)
        elif checks:
            self.check_published(field, round_)

    def check_published(self, field: int, round_: int) -> None:
        """``meet``'s checks, without its wait, for the peers that published ``field`` of
        ``round_`` already; ``check_late`` checks the others at a later call (with arrival flags,
        ep.wire.flags, the device orders the bytes and the host does not wait for the peers)."""
        self._check_now(field, round_, self._own_word(field, round_), range(self.num_ranks))

    def check_late(self) -> None:
        """``check_published``'s checks of the peers that have published since."""
        late, self.late = self.late, []
        for field, round_, mine, ranks in late:
            self._check_now(field, round_, mine, ranks)

    def _check_now(self, field: int, round_: int, mine: int, ranks) -> None:
        """Check the words of ``ranks`` that published ``round_`` against ``mine``; note the ranks
        not there yet in ``late`` (``wait_readers`` checks them before this rank's next round)."""
        words, behind = {}, []
        for r in ranks:
            if self.mailbox.round_of(r, field) < round_:
                behind.append(r)
            else:
                words[r] = self._word(r, field, round_)
        if behind:
            self.late.append((field, round_, mine, behind))
        self._check_words(field, round_, mine, words)

    def _own_word(self, field: int, round_: int) -> int:
        """This rank's word of ``round_`` (never replaced while this rank still checks that round)."""
        mailbox = self.mailbox
        return mailbox.config(self.rank, round_) if field == mb.DISPATCH else mailbox.combine_handle(self.rank, round_)

    def _word(self, rank: int, field: int, round_: int) -> int:
        """The word ``rank`` published with ``field`` of ``round_``: a dispatch's config or a
        combine's handle, still there (a peer is at most one round past this rank's last one:
        ``wait_readers``).

        Raises:
            MetadataError: the peer replaced it already, which only a peer that skips the round
                protocol can do: a word that cannot be checked is not taken as agreeing.
        """
        mailbox = self.mailbox
        word = mailbox.config_of(rank, round_) if field == mb.DISPATCH else mailbox.combine_handle(rank, round_)
        if word is None or mailbox.round_of(rank, field) > round_ + 1:
            raise MetadataError(f"ep: rank {rank} replaced its {'dispatch' if field == mb.DISPATCH else 'combine'} word "
                                f"of round {round_} before this rank checked it (it is at round "
                                f"{mailbox.round_of(rank, field)}); ranks run at most one round apart (Note [Mailbox "
                                "rounds] in ep.wire.mailbox), so it does not follow the round protocol")
        return word

    def _check_words(self, field: int, round_: int, mine: int, words: dict[int, int]) -> None:
        """``ConfigError`` when a rank's word of ``words`` is not ``mine``: another config (dispatch)
        or combine handle (combine) for ``round_`` than this rank's."""
        if field == mb.DISPATCH:
            if mine == REFUSED:  # this rank refused its arguments: it raises its own reason
                return
            refused = sorted(r for r, theirs in words.items() if r != self.rank and theirs == REFUSED)
            if refused:
                raise RefusedRound(f"ep.Buffer.dispatch: ranks {refused} refused their dispatch arguments (each raised "
                                   "why); nothing was sent, and the round is spent on every rank", refused)
            for r, theirs in words.items():
                if r != self.rank and theirs != mine:
                    raise ConfigError(f"ep.Buffer.dispatch: rank {r} dispatches with {describe_call(theirs)}, this rank "
                                      f"with {describe_call(mine)}; every rank must pass the same kind of call (a fresh "
                                      "dispatch with a hook sends through the copy engines, one without through the "
                                      "Buffer's sender)")
            return
        if mine == REFUSED:  # this rank refused its combine arguments: it raises its own reason
            return
        refused = sorted(r for r, theirs in words.items() if r != self.rank and theirs == REFUSED)
        if refused:
            raise RefusedRound(f"ep.Buffer.combine: ranks {refused} refused their combine arguments (each raised why); "
                               "the round is spent on every rank", refused)
        for r, theirs in words.items():  # rows are counted by the handle: all ranks must use the same dispatch's
            if combine_handle_round(theirs) != combine_handle_round(mine):
                raise ConfigError(f"ep.Buffer.combine: rank {r} combines with the handle of dispatch round "
                                  f"{combine_handle_round(theirs)}, this rank with round {combine_handle_round(mine)}; "
                                  "every rank must pass the handle of the same dispatch")
            if theirs != mine:
                raise ConfigError(f"ep.Buffer.combine: rank {r} combines with {describe_combine(theirs)}, this rank with "
                                  f"{describe_combine(mine)}; every rank must pass x of the same dtype, and topk_weights "
                                  "of the same width or none")

    def check_peer_configs(self, round_: int, config: int, ranks=None) -> None:
        """``ConfigError`` when a peer of ``ranks`` (default: all) published another config for ``round_``."""
        ranks = range(self.num_ranks) if ranks is None else ranks
        words = {r: self.mailbox.config_of(r, round_) for r in ranks}
        self._check_words(mb.DISPATCH, round_, config, {r: w for r, w in words.items() if w is not None})

    def complete_plan(self, handle: Handle, round_: int) -> None:
        """Fill in what needs every rank's counts of ``round_``: rows in each destination, rows from each source."""
        num_ranks, me, cap = self.num_ranks, self.rank, self.max_tokens
        epr = handle.num_experts // num_ranks
        mine = slice(me * epr, (me + 1) * epr)  # only this rank's experts are read
        matrix, per_expert = [], np.zeros(epr, dtype=np.int64)
        for s in range(num_ranks):  # plain lists: R is small, and this sits before the first copy
            per_rank, experts = self.mailbox.counts(s, round_, mine)
            row = handle.send_counts if s == me else per_rank.tolist()
            if min(row) < 0 or max(row) > cap:
                raise MetadataError(f"ep: rank {s} published counts {row}; expected each in [0, {cap}]")
            matrix.append(row)
            per_expert += experts
        fill_plan(handle, matrix, per_expert.tolist(), self.rank)
