"""How a receiver counts itself into a version and out again: one ``VersionSync`` per cycle.

Two protocols keep a publisher from writing what a receiver reads (DESIGN invariant 3):

* ``BoardSync``: every publisher is on this host and its manifest is read: shared locks on their
  version boards (Note [Version board] in ``refit._board``), no store round trip.
* ``StoreSync``: the others (another host, a board that cannot be opened, a publisher that moved
  on): reader counts in the store with heartbeat leases (Note [Version protocol], Note [Reader
  leases] in ``refit.protocol``).

``enter`` chooses once per cycle, at entry, and returns the sync that owns the rest of the
cycle's protocol: ``check_held`` after the bytes arrived and before anything is installed,
``leave`` when the cycle ends however it ends. The board path falls back to the store when a
publisher moved on (closed, restarted or died): the store says what comes next.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from warmlink._backoff import Backoff
from warmlink.errors import TransferTimeout, VersionError
from warmlink.refit import protocol
from warmlink.refit._board import CLOSED, PUBLISHED, STATE_NAMES, ReaderBoard

__all__ = ["VersionSync", "BoardSync", "StoreSync", "enter"]


class VersionSync(Protocol):
    """A version this receiver is inside on every publisher rank, for one cycle."""

    version: int

    def check_held(self, timeout_s: float) -> None:
        """Raise VersionError unless every publisher still counts this receiver in."""

    def leave(self, timeout_s: float) -> None:
        """Count out of ``version`` on every rank (store calls within ``timeout_s``, seconds)."""


def enter(sources, version: int | None, timeout_s: float, *, guess: bool) -> VersionSync:
    """Count in as a reader of every rank's current version (``version``, when given) of the
    publishers of ``sources`` (a ``SourceSet``), every store call within ``timeout_s`` of starting
    (a stalled store ends it, Note [Store deadlines]). ``guess``: try the states this process last
    read before reading them (Note [Warm metadata] in ``refit._memo``).

    Raises:
        TransferTimeout: the publishers did not agree on a published version within ``timeout_s``.
        VersionError: ``version`` was replaced by a newer one.
    """
    with _deadline(sources.store, timeout_s):
        boards = sources.boards()
        if boards is not None:
            entered = BoardSync.enter(*boards, version, timeout_s)
            if entered is not None:
                return entered
        return StoreSync.enter(sources, version, timeout_s, guess=guess)


class BoardSync:
    """Inside every publisher's version through its board: shared locks held until ``leave``."""

    __slots__ = ("version", "_boards")

    def __init__(self, version: int, boards: list[ReaderBoard]) -> None:
        self.version = version
        self._boards = boards

    @classmethod
    def enter(cls, boards: list[ReaderBoard], generations: list[int], version: int | None,
              timeout_s: float) -> BoardSync | None:
        """Enter every publisher's current version through its board; None when one moved on
        (closed, restarted or died): the store says more."""
        backoff = Backoff(timeout_s)
        while True:
            entered, versions, moved = [], set(), False
            for board, generation in zip(boards, generations):
                ok, ver, state = board.enter(generation, version)
                if not ok:
                    moved = state == CLOSED
                    if state == PUBLISHED and version is not None and ver > version:
                        for b in entered:
                            b.leave()
                        raise VersionError(f"Receiver.refit: version={version} was replaced by {ver}; ask for {ver} or None")
                    break
                entered.append(board)
                versions.add(ver)
            else:
                if len(versions) == 1:  # else some ranks published the next version already: wait for the rest
                    return cls(versions.pop(), entered)
            for b in entered:
                b.leave()
            if moved:
                return None
            if backoff.expired():
                raise TransferTimeout(
                    f"Receiver.refit: publishers did not agree on a published version within {timeout_s:.3f} s; "
                    f"states={[(v, STATE_NAMES.get(st, st)) for _, _, v, st in map(ReaderBoard.read, boards)]} (their boards)")
            backoff.sleep()

    def check_held(self, timeout_s: float) -> None:
        """Nothing to check: a publisher cannot take a shared lock away."""

    def leave(self, timeout_s: float) -> None:
        for board in self._boards:
            board.leave()


class StoreSync:
    """Counted in as a reader of every rank's version in the store, each rank's revocation count
    read at entry (Note [Reader leases])."""

    __slots__ = ("version", "_store", "_revoked")

    def __init__(self, version: int, store, revoked: list[int]) -> None:
        self.version = version
        self._store = store
        self._revoked = revoked  # per rank: checked before anything is installed

    @classmethod
    def enter(cls, sources, version: int | None, timeout_s: float, *, guess: bool) -> StoreSync:
        """Enter through the store, waiting (up to ``timeout_s``) until every rank publishes one version."""
        # Guess the states instead of reading them first, which saves a round trip per publisher:
        # a new receiver tries the states this process last read (an engine re-created per test:
        # nothing changed since), a receiver told which version to pull tries that version of the
        # generations it last read (the next step of an RL loop). Entering re-reads each state, so
        # a stale guess only costs a leave. See Note [Warm metadata] in refit._memo.
        guessed = _guessed_states(sources.store, sources.num_publishers) if guess else None
        if guessed is not None:
            if version is not None:
                guessed = [protocol.VersionState(version, "published", g.generation) for g in guessed]
            entered = cls._try_enter(sources, guessed, version)
            if entered is not None:
                return entered
        backoff = Backoff(timeout_s)
        while True:
            states = sources.states(timeout_s)
            entered = cls._try_enter(sources, states, version)
            if entered is not None:
                return entered
            if backoff.expired():
                raise TransferTimeout(
                    f"Receiver.refit: publishers did not agree on a published version within {timeout_s:.3f} s; "
                    f"states={[(s.version, s.state) for s in states]}"
                )
            backoff.sleep()

    @classmethod
    def _try_enter(cls, sources, states: list, version: int | None) -> StoreSync | None:
        """Inside the version of ``states`` on every rank, or None (counted out again) when not ready yet."""
        versions = {s.version for s in states}
        if len(versions) != 1 or any(s.state != "published" for s in states):
            return None
        (current,) = versions
        if version is not None and current > version:
            raise VersionError(f"Receiver.refit: version={version} was replaced by {current}; ask for {current} or None")
        if version is not None and current != version:
            return None
        store = sources.store
        entered, revoked = [], []
        try:
            for rank, s in enumerate(states):
                r = protocol.enter(store, rank, s)
                if r is None:
                    break
                entered.append(rank)
                revoked.append(r)
            else:
                # A bad manifest fails this refit, not the publishers' next update: the except
                # below leaves every version entered, so no reader count stays behind.
                sources.refresh(states)
                return cls(current, store, revoked)
        except BaseException:
            for rank in entered:
                protocol.leave(store, rank, current)
            raise
        for rank in entered:
            protocol.leave(store, rank, current)
        return None

    def check_held(self, timeout_s: float) -> None:
        """Raise unless every publisher still counts this receiver in: one that took it for dead
        (no heartbeat, Note [Reader leases]) may have written the tensors while the bytes moved."""
        with _deadline(self._store, timeout_s):
            for rank, r in enumerate(self._revoked):
                if not protocol.still_held(self._store, rank, r):
                    raise VersionError(
                        f"Receiver.refit: publisher/{rank} revoked this receiver's read of version {self.version} (no "
                        f"heartbeat for {protocol.LEASE_S:.1f} s: a stalled process?) and may have written since; "
                        "nothing from this pull is installed")

    def leave(self, timeout_s: float) -> None:
        """Count out on every rank within ``timeout_s``: a stalled store raises instead of holding
        the cycle (the counts are then the publisher's to reap)."""
        with _deadline(self._store, timeout_s):
            for rank in range(len(self._revoked)):
                protocol.leave(self._store, rank, self.version)


def _guessed_states(store, num_publishers: int) -> list | None:
    """The version state of every publisher rank this process last read through ``store``; None
    when a rank was never read or pooling is off (the memo then remembers nothing)."""
    guess = [protocol.last_state(store, rank) for rank in range(num_publishers)]
    return None if any(g is None for g in guess) else guess


def _deadline(store, timeout_s: float):
    """``store.deadline(timeout_s)`` (Note [Store deadlines]); a store without deadlines (a test
    double) keeps its calls' own limits."""
    deadline = getattr(store, "deadline", None)
    return deadline(timeout_s) if deadline is not None else contextlib.nullcontext()
