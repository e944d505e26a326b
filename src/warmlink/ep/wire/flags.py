"""Arrival flags: the GPU-side handshake that lets a combine or a cached dispatch return at launch.

# Note [Arrival flags]
Every rank's mailbox segment (ep.wire.mailbox) carries a page of 64-bit words in pinned host memory,
registered with CUDA in every process of the group, so that any rank's streams can store to it
and wait on it, and any rank's CPU can read and store it with no CUDA call:

- ``arrived[op][s]``: rank ``s``'s stream stores ``4 * round + part + 1`` once its rows of that
  part of ``op`` (dispatch or combine) are in this rank's receive area; this rank's receive
  stream waits for it (``cuStreamWaitValue64``) before the work that reads them;
- ``freed[op][d]``: rank ``d``'s stream stores ``round`` once its receive areas of ``op`` are free
  for round ``round + 2`` (a dispatch: its caller's stream reached round ``round + 1``, so no
  output view of round ``round`` is read any more; a combine: its sum of round ``round`` ran);
  this rank's copy stream or push waits for it before it writes round ``round + 2`` there.

A stream store follows a system-wide fence, so a receiver that sees the value sees the rows. No
host waits for any of it: the host only notes what each wait expects, with a deadline. Each
call's ``check`` (and, for a caller that stops calling, a watchdog thread that wakes at most once
a second) drops what was met; a wait past its deadline, or on a rank whose process died, fails
the Buffer: the error is raised by the Buffer's next call and every call after, and every word
this rank waits on is set to ``RELEASE`` from the CPU, and kept so until the Buffer closes (a slow
peer's stream may still store a round over it), so no stream of this process stays blocked on a
dead or stalled peer. The work those streams then run reads whatever the areas hold: after a failure,
outputs of the calls in flight are garbage, and the error says so.

A rank only ever releases its own words: a stalled rank that was released by a peer must not let
a third rank's streams pass.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np

from warmlink.errors import PeerLostError, TransferTimeout, WarmlinkError

__all__ = ["ArrivalFlags", "OPS", "RELEASE", "arrival_value", "flags_nbytes", "flags_page"]

OPS = ("dispatch", "combine")
RELEASE = 1 << 62  # above any round's value: a released wait passes
_WATCH_PERIOD_S = 1.0  # the watchdog's liveness checks while something is expected
PAGE = 4096


def flags_nbytes(num_ranks: int) -> int:
    """Bytes of one rank's flag words: ``arrived`` and ``freed``, per op and rank."""
    return 2 * len(OPS) * num_ranks * 8


def flags_page(mailbox_nbytes: int, num_ranks: int) -> tuple[int, int]:
    """``(offset, bytes)`` of the flag words' pages after a mailbox of ``mailbox_nbytes``: page
    aligned, so that registering them pins nothing else."""
    def up(n: int) -> int:
        return -(-n // PAGE) * PAGE

    return up(mailbox_nbytes), up(flags_nbytes(num_ranks))


def arrival_value(round_: int, part: int = 0) -> int:
    """What ``arrived`` holds once part ``part`` (0-3) of round ``round_`` landed."""
    return 4 * round_ + part + 1


class _Expected:
    __slots__ = ("deadline", "what", "words")

    def __init__(self, deadline: float, what: str, words: list[tuple[int, int, int]]) -> None:
        self.deadline, self.what, self.words = deadline, what, words  # words: (index, value, rank)


class ArrivalFlags:
    """This rank's flag words and its peers' (Note [Arrival flags]).

    Args:
        cuda: ``warmlink._cuda`` (tests pass a fake).
        own: this rank's words (``int64`` array of ``flags_nbytes // 8``, shared memory, zeroed
            before any peer could see them), and own_address: their device address. rank, num_ranks: this rank and the group size.
        timeout_s: how long a wait may take. peer_refs: ``{rank: PeerRef}`` for liveness.
    """

    def __init__(self, cuda, own: np.ndarray, own_address: int, rank: int, num_ranks: int, timeout_s: float,
                 peer_refs: dict) -> None:
        self._cuda = cuda
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, timeout_s
        self._words = {rank: own}
        self._addresses = {rank: own_address}
        self._refs = peer_refs
        self._expected: list[_Expected] = []
        self._lock = threading.Lock()
        self.error: WarmlinkError | None = None
        self._released = False  # failed or closing: this rank's words stay RELEASE until forget()

    def attach(self, rank: int, words: np.ndarray, address: int) -> None:
        """``rank``'s words, and their device address in this process."""
        self._words[rank], self._addresses[rank] = words, address

    def _index(self, kind: int, op: str, rank: int) -> int:
        return (kind * len(OPS) + OPS.index(op)) * self.num_ranks + rank

    # -- sender side ------------------------------------------------------------------------------
    def signal_arrived(self, stream: int, op: str, dests, value: int) -> None:
        """Once ``stream`` ran its work so far, tell each of ``dests`` its rows of ``value`` landed."""
        at = self._index(0, op, self.rank) * 8
        for d in dests:
            if d != self.rank:
                self._cuda.stream_write_value(stream, self._addresses[d] + at, value)

    def gate(self, stream: int, op: str, dests, round_: int) -> None:
        """Hold ``stream``'s later work until each of ``dests`` freed its areas of ``op`` for round
        ``round_`` (its ``freed`` word reached ``round_ - 2``). Round 1 and 2 need nothing."""
        need = round_ - 2
        if need < 1:
            return
        words = [(self._index(1, op, d), need, d) for d in dests if d != self.rank]
        self._wait(stream, words, f"{op} round {round_}: the receive areas of ranks {{ranks}} were not freed")

    # -- receiver side ----------------------------------------------------------------------------
    def wait_arrived(self, stream: int, op: str, sources, value: int, what: str) -> None:
        """Hold ``stream``'s later work until every one of ``sources`` signalled ``value``."""
        words = [(self._index(0, op, s), value, s) for s in sources if s != self.rank]
        self._wait(stream, words, what + " from ranks {ranks} did not arrive")

    def signal_freed(self, stream: int, op: str, round_: int) -> None:
        """Once ``stream`` ran its work so far, tell every peer this rank's areas of ``op`` are free
        up to ``round_`` (see the Note)."""
        at = self._index(1, op, self.rank) * 8
        for r, address in self._addresses.items():
            if r != self.rank:
                self._cuda.stream_write_value(stream, address + at, round_)

    def _wait(self, stream: int, words: list[tuple[int, int, int]], what: str) -> None:
        if not words:
            return
        base = self._addresses[self.rank]
        for index, value, _ in words:
            self._cuda.stream_wait_value(stream, base + index * 8, value)
        with self._lock:
            self._expected.append(_Expected(time.monotonic() + self.timeout_s, what, words))
        _WATCHDOG.watch(self)

    # -- host checks ------------------------------------------------------------------------------
    def check(self) -> None:
        """Drop the waits that were met; raise this Buffer's failure (a wait past its deadline, or on
        a dead rank), now or recorded before. Never blocks."""
        self.sweep(liveness=False)
        if self.error is not None:
            raise self.error

    def pending(self) -> bool:
        """Whether the watchdog has work here: waits to check, or released words to keep released."""
        with self._lock:
            return bool(self._expected) or self._released

    def sweep(self, liveness: bool) -> None:
        """Drop met waits; fail on a missed deadline, or on a dead rank (probed with ``liveness``,
        else only once a deadline passed). Once released, store ``RELEASE`` again: a peer that is
        slow, not dead, may have stored a round over it, which a wait of a later round, queued
        before the failure, would not pass."""
        now, own = time.monotonic(), self._words[self.rank]
        with self._lock:
            if self._released:
                own[:] = RELEASE
                return
            keep = []
            for e in self._expected:
                missing = sorted({r for index, value, r in e.words if own[index] < value})
                if not missing:
                    continue
                probe = liveness or now > e.deadline  # a liveness probe costs a syscall per rank
                dead = [r for r in missing if probe and not self._refs[r].alive()]
                if dead:
                    ref = self._refs[dead[0]]
                    self._fail(PeerLostError(f"ep: rank {dead[0]} (pid {ref.pid}) died; "
                                             f"{e.what.format(ranks=missing)}; outputs of the calls in flight are "
                                             "garbage and this Buffer is unusable: rebuild it"))
                    return
                if now > e.deadline:
                    self._fail(TransferTimeout(f"ep: {e.what.format(ranks=missing)} within {self.timeout_s:.3g} s; "
                                               "outputs of the calls in flight are garbage and this Buffer is unusable: "
                                               "rebuild it"))
                    return
                keep.append(e)
            self._expected = keep

    def _fail(self, error: WarmlinkError) -> None:
        """Record ``error`` and let every stream of this rank that waits on a flag go (see the Note)."""
        if self.error is None:
            self.error = error
        self._release()

    def _release(self) -> None:
        self._released = True
        self._words[self.rank][:] = RELEASE
        self._expected = []

    def close(self) -> None:
        """Stop expecting anything and let any stream still waiting go, until ``forget`` (the Buffer
        is closing: its streams drain, then its flag pages are unregistered)."""
        with self._lock:
            self._release()
        _WATCHDOG.watch(self)

    def forget(self) -> None:
        """Stop storing to this rank's words (its pages are about to go back to the pool)."""
        with self._lock:
            self._released = False
            self._expected = []
        _WATCHDOG.forget(self)


class _Watchdog:
    """One daemon thread per process, started by the first wait: once a second it sweeps every
    watched ``ArrivalFlags`` that expects something, with liveness checks. A deadline is at least
    ``timeout_s`` away when set, so a second's lateness is all a failure waits for."""

    def __init__(self) -> None:
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, flags: ArrivalFlags) -> None:
        if self._thread is not None and flags in self._watched:
            return
        with self._lock:
            self._watched.add(flags)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="warmlink-ep-watchdog", daemon=True)
                self._thread.start()

    def forget(self, flags: ArrivalFlags) -> None:
        with self._lock:
            self._watched.discard(flags)

    def _run(self) -> None:
        while True:
            time.sleep(_WATCH_PERIOD_S)
            with self._lock:
                watched = list(self._watched)
            for flags in watched:
                if flags.pending():
                    flags.sweep(liveness=True)


_WATCHDOG = _Watchdog()
