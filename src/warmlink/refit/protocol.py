"""The refit version protocol: who may touch published tensors, and when.

# Note [Version protocol]
Receivers that share the publisher's /dev/shm sync on its version board instead, through the
kernel's file locks (Note [Version board] in refit._board); this is the protocol of the others
(another host, or a board that cannot be opened), and the publisher waits for both.

Each publisher rank owns two store keys: ``pub/{rank}/state`` (JSON: version, state, generation)
and a counter ``pub/{rank}/readers/{version}``.

* A receiver *enters* version v of rank r: ``add(readers/v, +1)`` (``count_in``), then reads the
  publisher's version header (Note [Version header] in refit._header). If the header is not
  ``published v`` of the generation and manifest it planned against, it leaves (``add(-1)``) and
  tries what the header names, or waits.
* A receiver *leaves* after its pull completed or failed: ``add(readers/v, -1)``.
* A publisher *begins an update*: it writes ``updating`` to its header and ``state = updating v``,
  then waits until ``readers/v == 0``. Only then may the trainer write the tensors.
* A publisher *publishes* v+1: header and ``state`` say ``published v+1``.

If the publisher's read of ``readers/v`` saw 0, the receiver's increment came later (one TCPStore
server is linearizable), so its read of the header came after ``updating`` was written and it backs
off: the counts keep the trainer from writing under its readers. They carry no MAC, though, and the
store's values can be replayed, so what a receiver installs is decided by the headers, read again
after the pull (Note [Version header]): a forged count costs a retry, never a mix. The store's
``state`` only points a receiver at a version and generation to try.

# Note [Reader slots]
Counts are kept per receiver *process*: the first time a process reads from rank r it takes a
slot ``k = add(pub/{r}/reader_slots, 1)`` and writes its identity (``host:pid:start_time:token``,
the token naming its process lock: Note [Process locks] in ``pool.liveness``) to
``pub/{r}/reader_slot/{k}``; its enters and leaves then count on ``pub/{r}/readers/{v}/{k}``,
one round trip each, as before. The publisher reads the slot count after setting ``updating``
and sums the slots' counts; a slot taken after that read belongs to a receiver whose state read
comes later still, so the argument above holds per slot. A count held by a dead process is
reaped: the publisher subtracts it and logs a warning, and slots of dead processes are retired so
that ``begin_update`` never polls them again (its cost follows the live receiver processes, not
every process that ever joined). Dead means its process lock is free or gone, which holds in any
PID namespace, container or hostname that shares this host's /dev/shm; an identity without a
token (a process that could not make a lock) falls back to this host's pid table. A reader on
another host, or behind another /dev/shm, cannot be checked from here: its lease says whether it
lives (Note [Reader leases]). The token costs no cycle anything: it is written once with the slot
and read only when a slot is checked.

# Note [Reader leases]
A reader whose process lock cannot be checked here (another host, another /dev/shm) proves it
lives by its heartbeat: while a process is inside a version of rank r, a thread of its adds 1 to
``pub/{r}/beat/{slot}`` every BEAT_S. A publisher waiting on a slot whose heartbeat stands still
for LEASE_S takes it for dead: it first adds 1 to ``pub/{r}/revoked/{slot}``, then subtracts the
slot's count, and the update goes on. The beat is a counter, so no clocks are compared across
hosts.

A process that was only stalled (SIGSTOP, a long pause) may wake with its pull still running
while the trainer writes. Its read of the version header after the pull then shows the update the
revocation let in, and it installs nothing (with install="direct", PartialLoadError, as for any
failed direct pull): Note [Version header]. ``revoked`` stays as the publisher's record of whom
it took for dead.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from warmlink._backoff import wait_until
from warmlink.errors import MetadataError
from warmlink.pool import liveness
from warmlink.pool.core import PerOwner
from warmlink.refit._memo import read_states

log = logging.getLogger("warmlink.refit")

__all__ = ["VersionState", "read_state", "write_state", "count_in", "leave", "join_line", "leave_line", "line_waiting", "wait_no_readers", "state_key", "manifest_key",
           "last_state", "reader_count"]


def state_key(rank: int) -> str:
    return f"pub/{rank}/state"


def manifest_key(rank: int, generation: int) -> str:
    return f"pub/{rank}/manifest/{generation}"


def readers_key(rank: int, version: int, slot: int) -> str:
    return f"pub/{rank}/readers/{version}/{slot}"


def beat_key(rank: int, slot: int) -> str:
    return f"pub/{rank}/beat/{slot}"


def line_key(rank: int, slot: int) -> str:
    return f"pub/{rank}/line/{slot}"


def revoked_key(rank: int, slot: int) -> str:
    return f"pub/{rank}/revoked/{slot}"


BEAT_S = 0.5  # a reader inside a version beats this often (Note [Reader leases])
LEASE_S = 5.0  # a heartbeat standing still this long: the reader is dead or stalled, and revoked


class _Heart:
    """This process's heartbeat: one daemon thread beating for every (store, rank) it is inside.

    A forked child starts with nothing inside (``forget``): the versions its parent was reading
    are the parent's, and beating for them from the child would keep the parent's lease alive
    after the parent died."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self._inside: dict = {}  # (store, rank) -> [slot, cycles inside]
        self._lock = threading.Lock()  # new: the parent's may have been held by another thread at fork
        self._pid: int | None = None  # the process whose thread beats (a forked child has none)

    def beating_for(self) -> list[tuple[int, int]]:
        """(rank, slot) of every version this process is inside."""
        with self._lock:
            return [(rank, entry[0]) for (_, rank), entry in self._inside.items()]

    def start(self, store, rank: int, slot: int) -> None:
        with self._lock:
            entry = self._inside.setdefault((store, rank), [slot, 0])
            entry[1] += 1
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="warmlink-reader-heartbeat", daemon=True).start()

    def stop(self, store, rank: int) -> None:
        with self._lock:
            entry = self._inside.get((store, rank))
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._inside[(store, rank)]

    def _run(self) -> None:
        while True:
            time.sleep(BEAT_S)
            with self._lock:
                beating = [(store, rank, entry[0]) for (store, rank), entry in self._inside.items()]
            for store, rank, slot in beating:
                try:
                    store.add(beat_key(rank, slot), 1, checked=False, timeout_s=BEAT_S)
                except Exception:  # noqa: BLE001 - a missed beat is what a stalled store looks like
                    log.debug("heartbeat of publisher/%d slot %d missed", rank, slot, exc_info=True)


_heart = _Heart()
os.register_at_fork(after_in_child=_heart.forget)


# (store, rank) -> this process's reader slot (Note [Reader slots]): its identity at the publisher,
# not a cache, so it is kept with pooling off too.
_slots = PerOwner("reader_slot", counted=False, pooled=False)
_slot_lock = threading.Lock()
_IDENTITY = re.compile(r"(?P<host>[^:]{1,255}):(?P<pid>[0-9]{1,10}):(?P<start>[0-9]{1,20})(?::(?P<token>[^:]{1,200}))?")


def reader_slot(store, rank: int) -> int:
    """This process's reader slot at publisher ``rank`` (taken on first use, then remembered)."""
    slot = _slots.get(store, rank)
    if slot is None:
        from warmlink.transport.base import local_identity

        with _slot_lock:
            slot = _slots.get(store, rank)
            if slot is None:
                slot = store.add(f"pub/{rank}/reader_slots", 1, checked=False)
                host, pid, start = local_identity()
                token = liveness.token()  # its lock is held from here until this process exits
                store.set(f"pub/{rank}/reader_slot/{slot}", f"{host}:{pid}:{start}" + (f":{token}" if token else ""))
                _slots.put(store, rank, slot)
    return slot


# Receiver processes that ever read one publisher rank. The count comes from the store, which
# anyone who reaches its port can write: past this bound it is refused, not walked.
MAX_READER_SLOTS = 1 << 16


def num_reader_slots(store, rank: int) -> int:
    """The reader slots taken at publisher ``rank``. Raises MetadataError past MAX_READER_SLOTS."""
    total = _count(store, f"pub/{rank}/reader_slots")
    if not 0 <= total <= MAX_READER_SLOTS:
        raise MetadataError(f"store key 'pub/{rank}/reader_slots'={total} out of range; expected 0 to "
                            f"{MAX_READER_SLOTS} reader processes (a forged count?)")
    return total


def reader_count(store, rank: int, version: int, slots=None) -> int:
    """Receivers inside ``version`` of ``rank``, summed over reader slots (all, or ``slots``)."""
    if slots is None:
        slots = range(1, num_reader_slots(store, rank) + 1)
    return sum(store.add(readers_key(rank, version, k), 0, checked=False) for k in slots)


@dataclass(frozen=True, slots=True)
class VersionState:
    version: int
    state: str  # "published" | "updating"
    generation: int

    def to_json(self) -> dict:
        return {"schema_version": 1, "kind": "version_state", "version": self.version, "state": self.state, "generation": self.generation}


def write_state(store, rank: int, state: VersionState) -> None:
    store.set_json(state_key(rank), state.to_json())


def read_state(store, rank: int, *, timeout_s: float | None = None) -> VersionState:
    obj = store.get_json(state_key(rank), "version_state", f"publisher/{rank}", timeout_s=timeout_s)
    state = VersionState(obj["version"], obj["state"], obj["generation"])
    read_states.put(store, rank, state)  # a new receiver's first guess: Note [Warm metadata] in refit._memo
    return state


def last_state(store, rank: int) -> VersionState | None:
    """The state of ``rank`` this process last read through ``store``, or None (never read, or
    pooling off): a guess only."""
    return read_states.get(store, rank)


def count_in(store, rank: int, version: int) -> None:
    """Count this process in as a reader of ``version`` of ``rank`` and start beating (Note [Reader
    leases]). Whether that version is the one published is for the version header to say (Note
    [Version header] in refit._header); ``leave`` counts out."""
    slot = reader_slot(store, rank)
    _add_own(store, readers_key(rank, version, slot), 1)
    _heart.start(store, rank, slot)


def leave(store, rank: int, version: int) -> None:
    _heart.stop(store, rank)  # first: a leave the store never got leaves a count without a beat
    _add_own(store, readers_key(rank, version, reader_slot(store, rank)), -1)


def _slot_dead(store, rank: int, slot: int) -> bool:
    """True when ``slot``'s process is known to be gone (Note [Reader slots]). The identity is peer
    metadata: anything malformed, or a token that cannot be checked here, is alive (never reaped)."""
    import socket

    from warmlink.transport.base import process_start_time

    raw = store.try_get(f"pub/{rank}/reader_slot/{slot}")
    m = _IDENTITY.fullmatch(raw.decode("utf-8", "replace")) if raw is not None else None
    if m is None:
        return False
    if m["token"] is not None:
        return liveness.token_alive(m["token"], pid=int(m["pid"])) is False
    if m["host"] != socket.gethostname():
        return False
    start = process_start_time(int(m["pid"]))
    return start is None or (start != -1 and int(m["start"]) not in (0, start))


# (store, rank) -> slots whose processes were found dead: never polled again by this publisher
# process, whatever the pool switch says (a dead slot stays dead)
_retired = PerOwner("retired_reader_slots", counted=False, pooled=False)
_SWEEP_ABOVE = 8  # with more live slots than this, each begin_update checks a few for dead processes
_SWEEP_PER_CALL = 4
_DEAD_CHECK_S = 0.25


def _count(store, key: str) -> int:
    """The counter under ``key``; one that holds anything but an integer in range (written by a
    process without the secret) is removed, with a warning, and counts 0: what a receiver installs
    does not rest on counts (Note [Version header] in refit._header), so garbage costs its writer
    the key, not this publisher its update."""
    try:
        return store.add(key, 0, checked=False)
    except MetadataError as exc:
        log.warning("store key %r is not a counter (%s); removed", key, exc)
        store.delete(key)
        return 0


def join_line(store, rank: int) -> None:
    """Stand in line for ``rank``'s next version (Note [Reader line] in refit._board)."""
    _add_own(store, line_key(rank, reader_slot(store, rank)), 1)


def leave_line(store, rank: int) -> None:
    _add_own(store, line_key(rank, reader_slot(store, rank)), -1)


def line_waiting(store, rank: int) -> bool:
    """Whether a live reader process of ``rank`` stands in line (Note [Reader line] in refit._board):
    counts of dead processes are taken back; one below zero (forged) is set back to 0."""
    retired = _retired.get(store, rank) or set()
    waiting = False
    for k in range(1, num_reader_slots(store, rank) + 1):
        if k in retired:
            continue
        key = line_key(rank, k)
        count = _count(store, key)
        if count < 0:
            store.add(key, -count, checked=False)
        elif count > 0:
            if _slot_dead(store, rank, k):
                store.add(key, -count, checked=False)
            else:
                waiting = True
    return waiting


def _add_own(store, key: str, amount: int) -> None:
    """Add to a counter of this process's own slot. Garbage there (written by a process without the
    secret) held no count of ours: it is removed, with a warning, and a count in made on a clean
    key (a count out has nothing left to take back), so the write costs a warning, not this
    receiver its cycle."""
    try:
        store.add(key, amount, checked=False)
    except MetadataError as exc:
        log.warning("store key %r is not a counter (%s); removed", key, exc)
        store.delete(key)
        if amount > 0:
            store.add(key, amount, checked=False)


def _lease_expired(store, rank: int, slot: int, beats: dict, now: float) -> bool:
    """Whether ``slot``'s heartbeat stood still for LEASE_S of this wait (Note [Reader leases])."""
    beat = _count(store, beat_key(rank, slot))
    seen = beats.get(slot)
    if seen is None or seen[0] != beat:
        beats[slot] = (beat, now)
        return False
    return now - seen[1] >= LEASE_S


def wait_no_readers(store, rank: int, version: int, timeout_s: float) -> None:
    """Block until no receiver reads ``version`` of ``rank``, reaping counts of dead local processes
    (Note [Reader slots]) and revoking readers whose heartbeat stood still for LEASE_S (Note
    [Reader leases]); TransferTimeout after ``timeout_s``, the store's calls included."""
    retired = _retired.get(store, rank) or set()
    holding: dict[int, int] = {}
    beats: dict[int, tuple[int, float]] = {}  # slot -> (its beat count, when that count was first seen)
    next_check = 0.0  # look for dead holders now, then every _DEAD_CHECK_S: a killed process may
    sweep = True      # still be exiting (Ray reports an actor dead before its process is gone)

    def drained() -> bool:
        nonlocal holding, next_check, sweep
        while True:
            total = num_reader_slots(store, rank)
            live = [k for k in range(1, total + 1) if k not in retired]
            if sweep and len(live) > _SWEEP_ABOVE:  # retire a few idle dead slots per update, oldest first
                sweep = False
                for k in live[:_SWEEP_PER_CALL]:
                    if _slot_dead(store, rank, k):
                        retired.add(k)
                live = [k for k in live if k not in retired]
            counts = {k: _count(store, readers_key(rank, version, k)) for k in live}
            for k, c in counts.items():
                if c < 0:  # no reader leaves more than it entered: forged; set back to 0
                    log.warning("store key %r=%d below zero (forged?); set to 0", readers_key(rank, version, k), c)
                    store.add(readers_key(rank, version, k), -c, checked=False)
            holding = {k: c for k, c in counts.items() if c > 0}
            if not holding:
                return True
            now = time.monotonic()
            if now < next_check:
                return False
            next_check = now + _DEAD_CHECK_S
            reaped = False
            for k, count in holding.items():
                if _slot_dead(store, rank, k):
                    store.add(readers_key(rank, version, k), -count, checked=False)
                    retired.add(k)
                    log.warning("reaped %d reader(s) of publisher/%d version %d left by dead process in slot %d",
                                count, rank, version, k)
                    reaped = True
                elif _lease_expired(store, rank, k, beats, now):
                    store.add(revoked_key(rank, k), 1, checked=False)  # first: see Note [Reader leases]
                    store.add(readers_key(rank, version, k), -count, checked=False)
                    beats.pop(k, None)
                    log.warning("revoked %d reader(s) of publisher/%d version %d in slot %d: no heartbeat for "
                                "%.1f s (dead, or stalled on another host)", count, rank, version, k, LEASE_S)
                    reaped = True
            if not reaped:
                return False

    with store.deadline(timeout_s):  # its round trips too: Note [Store deadlines] in rendezvous.store
        wait_until(drained, timeout_s=timeout_s, what=lambda: (
            f"Publisher.begin_update: publisher/{rank} version {version} still has {sum(holding.values())} "
            f"reader(s) after {timeout_s:.3f} s; a receiver died or stalled mid-pull"))
    _retired.put(store, rank, retired)
