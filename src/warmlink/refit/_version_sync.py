"""How a receiver counts itself into a version and out again: one ``VersionSync`` per cycle.

Two protocols keep a publisher from writing what a receiver reads (DESIGN invariant 3):

* ``BoardSync``: every publisher is on this host and its manifest is read: shared locks on their
  version boards (Note [Version board] in ``refit._board``), no store round trip.
* ``StoreSync``: the others (another host, a board that cannot be opened, a publisher that moved
  on, and every first cycle, whose board comes with the manifest it loads): reader counts in the
  store with heartbeat leases (Note [Version protocol], Note [Reader leases] in
  ``refit.protocol``), and what is installed checked against the publishers' version headers,
  which only they write, before and after the pull (Note [Version header] in ``refit._header``):
  the store's values only point the way.

Both stand in line while a publisher updates (Note [Reader line] in ``refit._board``).

``enter`` chooses once per cycle, at entry, and returns the sync that owns the rest of the
cycle's protocol: ``check_held`` after the bytes arrived and before anything is installed,
``leave`` when the cycle ends however it ends. The board path falls back to the store when a
publisher moved on (closed, restarted or died): the store says what comes next.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from warmlink._backoff import Backoff
from warmlink.errors import MetadataError, PeerLostError, TransferTimeout, VersionError
from warmlink.refit import protocol
from warmlink.refit._board import CLOSED, PUBLISHED, STATE_NAMES, UPDATING, ReaderBoard

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
        try:
            return cls._enter(boards, generations, version, timeout_s)
        finally:
            for board in boards:
                board.leave_line()

    @classmethod
    def _enter(cls, boards: list[ReaderBoard], generations: list[int], version: int | None,
               timeout_s: float) -> BoardSync | None:
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
                    if state == UPDATING and (version is None or version <= ver + 1):
                        board.join_line()  # the next version waits for this receiver: Note [Reader line]
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
    """Counted in as a reader of every rank's version in the store, with the version headers read
    at entry (Note [Version header]), compared again before anything is installed."""

    __slots__ = ("version", "_store", "_sources", "_headers")

    def __init__(self, version: int, store, sources, headers: list) -> None:
        self.version = version
        self._store = store
        self._sources = sources
        self._headers = headers

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
            try:
                entered, _, _ = cls._try_enter(sources, guessed, version, timeout_s)
            except PeerLostError:  # the guess named a publisher process that has since gone: the store says more
                entered = None
            if entered is not None:
                return entered
        backoff = Backoff(timeout_s)
        hint, why, in_line = None, None, []
        try:
            while True:
                # The headers' word over the store's when they named a version to try (a replayed
                # state in the store then costs one retry): Note [Version header].
                states = hint if hint is not None else sources.states(timeout_s)
                entered, hint, why = cls._try_enter(sources, states, version, timeout_s)
                if entered is not None:
                    return entered
                if not in_line and _next_is_wanted(states, version):
                    for rank in range(len(states)):  # Note [Reader line] in refit._board
                        protocol.join_line(sources.store, rank)
                        in_line.append(rank)
                if backoff.expired():
                    raise TransferTimeout(
                        f"Receiver.refit: publishers did not agree on a published version within {timeout_s:.3f} s; "
                        f"states={[(s.version, s.state) for s in states]}" + (f"; {why}" if why else ""))
                if hint is None:
                    backoff.sleep()
        finally:
            for rank in in_line:
                protocol.leave_line(sources.store, rank)

    @classmethod
    def _try_enter(cls, sources, states: list, version: int | None, timeout_s: float) -> tuple:
        """``(sync, None, None)`` inside the version of ``states`` on every rank and matching every
        version header; else ``(None, hint, why)``, counted out again: ``hint`` the states the
        headers name, to try next (None: wait), ``why`` what did not match."""
        versions = {s.version for s in states}
        if len(versions) != 1 or any(s.state != "published" for s in states):
            # The store says wait; the headers say whether to (a replayed "updating" would hold
            # every store-synced receiver out until the next version otherwise).
            return None, _published_now(sources, states, timeout_s), None
        (current,) = versions
        if version is not None and current > version:
            raise VersionError(f"Receiver.refit: version={version} was replaced by {current}; ask for {current} or None")
        if version is not None and current != version:
            return None, None, None
        store = sources.store
        entered = []
        try:
            for rank in range(len(states)):
                protocol.count_in(store, rank, current)
                entered.append(rank)
            # A bad manifest fails this refit, not the publishers' next update: the except below
            # leaves every version entered, so no reader count stays behind.
            sources.refresh(states)
            headers = sources.read_headers(timeout_s)  # after counting in: Note [Version protocol]
            if _foreign_manifests(sources, headers):  # read them again once: a new export may have replaced them
                sources.unverify()
                sources.refresh(states)
                foreign = _foreign_manifests(sources, headers)
                if foreign:
                    rank = foreign[0]
                    raise MetadataError(
                        f"Receiver.refit: publisher/{rank}'s manifest at pub/{rank}/manifest/{states[rank].generation} is "
                        "not the one its version header names (another digest): written or replaced in the store by a "
                        "process other than that publisher (a replayed or forged value); refused")
            hint, why = _disagreement(sources, headers, current)
            if why is None:
                return cls(current, store, sources, headers), None, None
        except BaseException:
            for rank in entered:
                protocol.leave(store, rank, current)
            raise
        for rank in entered:
            protocol.leave(store, rank, current)
        return None, (hint if hint != states else None), why

    def check_held(self, timeout_s: float) -> None:
        """Raise unless every publisher's version header shows no write since entry: one drained
        for an update, published since or closed may have written while the bytes moved, whatever
        the store's counts said (Note [Version header])."""
        now = self._sources.read_headers(timeout_s)
        for rank, (before, after) in enumerate(zip(self._headers, now)):
            if not before.same_version(after):
                raise VersionError(
                    f"Receiver.refit: publisher/{rank}'s version header moved from {before.describe()} to "
                    f"{after.describe() if after is not None else 'no header'} while this receiver read version "
                    f"{self.version}: it let its trainer write although this receiver was counted in (a read it "
                    f"revoked as stalled, or reader counts altered in the store, pub/{rank}/readers/...); nothing "
                    "from this pull is installed")

    def leave(self, timeout_s: float) -> None:
        """Count out on every rank within ``timeout_s``: a stalled store raises instead of holding
        the cycle (the counts are then the publisher's to reap)."""
        with _deadline(self._store, timeout_s):
            for rank in range(len(self._headers)):
                protocol.leave(self._store, rank, self.version)


def _next_is_wanted(states: list, version: int | None) -> bool:
    """Whether a receiver waiting on ``states`` wants the version being made now, so stands in line
    for it (Note [Reader line] in refit._board): not one waiting for a later version, which would
    hold up the updates it waits for."""
    updating = [s.version for s in states if s.state == "updating"]
    return bool(updating) and (version is None or version <= max(updating) + 1)


def _published_now(sources, states: list, timeout_s: float) -> list | None:
    """The states every version header names when each says ``published``, one version, the
    generation and digest of the manifest the store's state points at; else None."""
    sources.refresh(states)
    headers = sources.read_headers(timeout_s)
    versions = {h.version for h in headers if h is not None}
    if len(versions) != 1 or any(h is None or h.state != PUBLISHED for h in headers):
        return None
    hint = [protocol.VersionState(h.version, "published", h.generation) for h in headers]
    return hint if _disagreement(sources, headers, versions.pop())[1] is None else None


def _foreign_manifests(sources, headers: list) -> list[int]:
    """Ranks whose header is of the generation of the manifest loaded but carries another digest:
    that manifest is not the one the publisher wrote (Note [Version header])."""
    return [rank for rank, (h, generation, digest) in enumerate(zip(headers, sources.generations(), sources.header_digests()))
            if h is not None and h.generation == generation and h.digest != digest]


def _disagreement(sources, headers: list, version: int) -> tuple[list | None, str | None]:
    """``(None, None)`` when every header says ``published``, ``version``, the generation and the
    digest of the manifest loaded; else the states the headers name (None: a header says updating,
    or none could be read: wait) and what disagreed, naming the rank."""
    generations, digests = sources.generations(), sources.header_digests()
    hint, why = [], None
    for rank, (h, generation, digest) in enumerate(zip(headers, generations, digests)):
        if h is not None and h.state == PUBLISHED and h.version == version and h.generation == generation and h.digest == digest:
            if hint is not None:
                hint.append(protocol.VersionState(version, "published", generation))
            continue
        why = why or (f"publisher/{rank}'s version header says " + (h.describe() if h is not None else "nothing (no header "
                      "in the region its manifest names)") + f", its state in the store version {version} of generation "
                      f"{generation} (a replayed or stale value at pub/{rank}/state or pub/{rank}/manifest/{generation}?)")
        if h is None or h.state != PUBLISHED or (h.generation == generation and h.digest != digest):
            hint = None  # nothing better to try: the store's next word, or the header's
        elif hint is not None:
            hint.append(protocol.VersionState(h.version, "published", h.generation))
    if why is None:
        return None, None
    if hint is not None and len({s.version for s in hint}) != 1:
        hint = None  # ranks between versions: wait for the rest
    return hint, why


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
