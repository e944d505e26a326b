"""Host mailboxes: the handshakes of dispatch and combine, in shared memory, without a kernel.

Every rank owns one small ``/dev/shm`` segment and is its only writer; peers map it and read.
A rank publishes what its peers need (its counts, "I am ready for round N", "round N is sent")
and spins on the host, with a deadline and a liveness check, until every peer has published the
same round. No SM polls anything, and no store round trip sits on the hot path.

# Note [Mailbox rounds]
Round numbers only grow. A reader waits for ``field >= round``, so a peer that is already one
round ahead does not stall it. The counts and the config word of round ``n`` live in parity
``n % 2``, and the combine's handle word too, so round ``n + 2`` replaces them. Before a rank
publishes round ``n`` of a field it waits until every peer published round ``n - 1``, and then
checks the words of the peers it found late before (``Rounds.wait_readers``). So a peer publishes
round ``n + 2`` only after this rank published round ``n + 1``, by which time this rank has read
every count and checked every word of round ``n``: ranks run at most one round apart, and no word
goes unchecked. (Without that bound, calls that meet no one, cached and padded dispatches and
combines, let a peer that refused round ``n`` and called twice more replace its word unchecked,
and this rank kept that round's rows, sent under another config, without an error.) Each parity's
config word still carries the round it is of (``config_of``), and a word found replaced raises
``MetadataError`` instead of passing. A writer stores the payload before the round number; x86
keeps stores in order and loads in order, so a reader that sees the round sees the payload. An
ARM host (Grace) would need explicit fences, which Python cannot issue here, so a mailbox refuses
to open on any other architecture instead of racing.
"""

from __future__ import annotations

import os
import platform

import numpy as np

from warmlink._backoff import wait_until
from warmlink.ep.wire.regions import MAX_EXPERTS
from warmlink.errors import BackendUnavailable

__all__ = ["COMBINE", "COMBINE_RECEIVED", "COMBINE_SENT", "DISPATCH", "DISPATCH_RECEIVED", "DISPATCH_SENT", "MAX_EXPERTS",
           "MEET", "Mailbox", "mailbox_nbytes"]

GENERATION, DISPATCH, DISPATCH_SENT, COMBINE, COMBINE_SENT, COMBINE_HANDLE = range(6)  # COMBINE_HANDLE: 2 words
# "received": every round up to this one was received here (ep.low_latency._runtime, Note [Low-latency rounds])
DISPATCH_RECEIVED, COMBINE_RECEIVED = 7, 8
MEET, MEET_VALUE = 9, 10  # Buffer.all_gather_int: its round, then one value word per parity (2 words)
_HEADER = 12
_FIELD_NAMES = {DISPATCH: "dispatch", DISPATCH_SENT: "dispatch sent", COMBINE: "combine", COMBINE_SENT: "combine sent",
                DISPATCH_RECEIVED: "dispatch received", COMBINE_RECEIVED: "combine received", MEET: "all_gather_int"}
_STORE_ORDERED = ("x86_64", "amd64")  # total store order: see Note [Mailbox rounds]
_LIVENESS_PERIOD_S = 0.005
# Busy-wait this long before sleeping: ranks of one step reach a handshake within a few hundred
# microseconds of each other, and a 100 us sleep (Linux wakes later than asked) would add itself to
# every dispatch. One core per rank spins for at most this long per wait, and only when the host
# has a spare core per rank (on a small CI machine spinning would starve the peer it waits for).
_SPIN_S = 5e-3
_SHORT_SPIN_S = 50e-6


def _block(num_ranks: int) -> int:
    """Words of one parity block: the call's config word, counts per rank, counts per expert, and
    the round the config word is of (``Mailbox.config_of``)."""
    return 2 + num_ranks + MAX_EXPERTS


def _words(num_ranks: int) -> int:
    return _HEADER + 2 * _block(num_ranks)


def mailbox_nbytes(num_ranks: int) -> int:
    return _words(num_ranks) * 8


class Mailbox:
    """This rank's mailbox and read views of its peers'.

    Args:
        own: flat ``uint8`` CPU tensor of ``mailbox_nbytes(num_ranks)`` bytes in shared memory.
        rank, num_ranks: this rank and the group size.
    """

    def __init__(self, own, rank: int, num_ranks: int) -> None:
        machine = platform.machine()
        if machine.lower() not in _STORE_ORDERED:
            raise BackendUnavailable(
                f"ep mailbox: this host is {machine!r}; the handshake relies on x86's store and load order "
                "(Note [Mailbox rounds] in warmlink.ep.wire.mailbox) and has no memory fences for other CPUs yet")
        self.rank = rank
        self.num_ranks = num_ranks
        self._own = own.numpy().view(np.int64)[: _words(num_ranks)]
        self._own[:] = 0
        self._peers: dict[int, np.ndarray] = {rank: self._own}
        self._refs: dict[int, object] = {}
        self._spin_s = _SPIN_S if (os.cpu_count() or 1) >= 2 * num_ranks else _SHORT_SPIN_S

    def attach(self, rank: int, view, peer_ref) -> None:
        """Read ``rank``'s mailbox through ``view`` (its mapped segment); ``peer_ref.alive()`` is polled."""
        self._peers[rank] = view.numpy().view(np.int64)[: _words(self.num_ranks)]
        self._refs[rank] = peer_ref

    def set_generation(self, generation: int) -> None:
        self._own[GENERATION] = generation

    # -- writing (own slot only) ----------------------------------------------------------------
    def publish(self, field: int, round_: int) -> None:
        self._own[field] = round_

    def _base(self, round_: int) -> int:
        return _HEADER + (round_ % 2) * _block(self.num_ranks)

    def _tag(self, round_: int) -> int:
        return self._base(round_) + _block(self.num_ranks) - 1

    def publish_dispatch(self, round_: int, config: int, per_rank=None, per_expert=None) -> None:
        """The config word (and counts) of dispatch round ``round_``, then the round itself.
        See Note [Mailbox rounds]."""
        base, tag = self._base(round_), self._tag(round_)
        self._own[tag] = 0  # the config word is being replaced: see config_of
        self._own[base] = config
        if per_rank is not None:
            r = self.num_ranks
            self._own[base + 1:base + 1 + r] = per_rank
            self._own[base + 1 + r:base + 1 + r + len(per_expert)] = per_expert
        self._own[tag] = round_
        self._own[DISPATCH] = round_

    def publish_combine(self, round_: int, word: int) -> None:
        """The combine word of ``round_`` (ep.wire.words.encode_combine: its handle's dispatch
        round, dtype and weights) in its parity word, then the round."""
        self._own[COMBINE_HANDLE + round_ % 2] = word
        self._own[COMBINE] = round_

    def combine_handle(self, rank: int, round_: int) -> int:
        return int(self._peers[rank][COMBINE_HANDLE + round_ % 2])

    def publish_meet(self, round_: int, value: int) -> None:
        """``value`` for meet ``round_`` in its parity word, then the round (Note [Mailbox rounds])."""
        self._own[MEET_VALUE + round_ % 2] = value
        self._own[MEET] = round_

    def meet_value(self, rank: int, round_: int) -> int:
        return int(self._peers[rank][MEET_VALUE + round_ % 2])

    # -- reading --------------------------------------------------------------------------------
    def counts(self, rank: int, round_: int, experts: slice) -> tuple[np.ndarray, np.ndarray]:
        """``(per_rank [R], per_expert[experts])`` that ``rank`` published for ``round_`` (copies)."""
        base, r = self._base(round_) + 1, self.num_ranks
        box = self._peers[rank]
        return box[base:base + r].copy(), box[base + r + experts.start:base + r + experts.stop].copy()

    def round_of(self, rank: int, field: int) -> int:
        """The round ``rank`` last published in ``field``."""
        return int(self._peers[rank][field])

    def published(self, field: int, round_: int) -> list[int]:
        """The ranks (this one included) whose ``field`` has reached ``round_``, without waiting."""
        return [r for r, box in self._peers.items() if box[field] >= round_]

    def config(self, rank: int, round_: int) -> int:
        return int(self._peers[rank][self._base(round_)])

    def config_of(self, rank: int, round_: int) -> int | None:
        """``rank``'s config word of dispatch round ``round_``, or None once a later round of its
        parity replaces it (or is replacing it). The writer clears the parity's tag before the
        word and stores the round after it; stores and loads stay in order (Note [Mailbox
        rounds]), so a tag read as ``round_`` both before and after the word vouches for it."""
        box, tag = self._peers[rank], self._tag(round_)
        before = int(box[tag])
        word = int(box[self._base(round_)])
        return word if before == round_ and int(box[tag]) == round_ else None

    def wait(self, field: int, round_: int, timeout_s: float, ranks=None) -> None:
        """Block until every rank in ``ranks`` (default: all peers) has ``field >= round_``.

        Raises:
            PeerLostError: a peer's process died or was replaced.
            TransferTimeout: not reached within ``timeout_s``; names the ranks still behind.
        """
        pending = [r for r in (ranks if ranks is not None else self._peers) if r != self.rank]
        name = _FIELD_NAMES.get(field, field)

        def reached() -> bool:
            pending[:] = [r for r in pending if self._peers[r][field] < round_]
            return not pending

        def lost() -> str | None:
            for r in pending:
                ref = self._refs.get(r)
                if ref is not None and not ref.alive():
                    return f"ep: rank {r} (pid {ref.pid}) died before publishing {name} round {round_}"
            return None

        def late() -> str:
            behind = {r: int(self._peers[r][field]) for r in pending}
            return (f"ep: ranks {sorted(behind)} did not reach {name} round {round_} within {timeout_s:.3g} s "
                    f"(their rounds: {behind}); a peer is stalled, or the ranks called dispatch/combine a different "
                    "number of times")

        wait_until(reached, timeout_s=timeout_s, what=late, lost=lost, first_s=50e-6, cap_s=500e-6, spin_s=self._spin_s,
                   every_s=_LIVENESS_PERIOD_S)
