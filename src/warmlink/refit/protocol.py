"""The refit version protocol: who may touch published tensors, and when.

# Note [Version protocol]
Receivers that share the publisher's /dev/shm sync on its version board instead, through the
kernel's file locks (Note [Version board] in refit._board); this is the protocol of the others
(another host, or a board that cannot be opened), and the publisher waits for both.

Each publisher rank owns two store keys: ``pub/{rank}/state`` (JSON: version, state, generation)
and a counter ``pub/{rank}/readers/{version}``.

* A receiver *enters* version v of rank r: ``add(readers/v, +1)``, then reads ``state``. If the state
  is not ``published v`` of the generation it planned against, it leaves (``add(-1)``) and waits.
* A receiver *leaves* after its pull completed or failed: ``add(readers/v, -1)``.
* A publisher *begins an update*: it sets ``state = updating v``, then waits until
  ``readers/v == 0``. Only then may the trainer write the tensors.
* A publisher *publishes* v+1: it sets ``state = published v+1``.

The store is linearizable (one TCPStore server), so the two orders cannot cross: if the publisher's
read of ``readers/v`` saw 0, the receiver's increment came later, so its read of ``state`` came after
``updating`` was set and it backs off. Hence the trainer never overwrites tensors a receiver is
reading. A receiver installs only after every byte of every rank arrived (see receiver.py), so it
holds the old version or the new one, never a mix.

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
another host, or behind another /dev/shm, cannot be checked from here: like a live reader that
never leaves, its count ends in TransferTimeout naming the version and count. The token costs no
cycle anything: it is written once with the slot and read only when a slot is checked.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

from warmlink._backoff import wait_until
from warmlink.errors import MetadataError, VersionError
from warmlink.pool import liveness
from warmlink.refit._memo import PerStore

log = logging.getLogger("warmlink.refit")

__all__ = ["VersionState", "read_state", "write_state", "enter", "leave", "wait_no_readers", "state_key", "manifest_key",
           "last_state", "reader_count"]

# rank -> the VersionState this process last read through a Store object: a new receiver's first
# guess (Note [Warm metadata] in refit._memo). Never trusted: entering reads the state again.
_last_read = PerStore()


def state_key(rank: int) -> str:
    return f"pub/{rank}/state"


def manifest_key(rank: int, generation: int) -> str:
    return f"pub/{rank}/manifest/{generation}"


def readers_key(rank: int, version: int, slot: int) -> str:
    return f"pub/{rank}/readers/{version}/{slot}"


_slots = PerStore()  # (store, rank) -> this process's reader slot. See Note [Reader slots].
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
    total = store.add(f"pub/{rank}/reader_slots", 0, checked=False)
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
    _last_read.put(store, rank, state)
    return state


def last_state(store, rank: int) -> VersionState | None:
    """The state of ``rank`` this process last read through ``store``, or None: a guess only."""
    return _last_read.get(store, rank)


def enter(store, rank: int, expected: VersionState) -> bool:
    """Count this receiver in as a reader of ``expected``; False (and counted out) if it moved on."""
    if expected.state != "published":
        raise VersionError(f"enter: publisher/{rank} state={expected.state!r}; expected 'published'")
    key = readers_key(rank, expected.version, reader_slot(store, rank))
    store.add(key, 1, checked=False)
    now = read_state(store, rank)
    if now == expected:
        return True
    store.add(key, -1, checked=False)
    return False


def leave(store, rank: int, version: int) -> None:
    store.add(readers_key(rank, version, reader_slot(store, rank)), -1, checked=False)


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


# rank -> slots whose processes were found dead: never polled again by this publisher process
_retired = PerStore()
_SWEEP_ABOVE = 8  # with more live slots than this, each begin_update checks a few for dead processes
_SWEEP_PER_CALL = 4
_DEAD_CHECK_S = 0.25


def wait_no_readers(store, rank: int, version: int, timeout_s: float) -> None:
    """Block until no receiver reads ``version`` of ``rank``, reaping counts of dead local processes
    (Note [Reader slots]); TransferTimeout after ``timeout_s``, the store's calls included."""
    retired = _retired.get(store, rank) or set()
    holding: dict[int, int] = {}
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
            counts = {k: store.add(readers_key(rank, version, k), 0, checked=False) for k in live}
            holding = {k: c for k, c in counts.items() if c}
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
            if not reaped:
                return False

    with store.deadline(timeout_s):  # its round trips too: Note [Store deadlines] in rendezvous.store
        wait_until(drained, timeout_s=timeout_s, what=lambda: (
            f"Publisher.begin_update: publisher/{rank} version {version} still has {sum(holding.values())} "
            f"reader(s) after {timeout_s:.3f} s; a receiver died or stalled mid-pull"))
    _retired.put(store, rank, retired)
