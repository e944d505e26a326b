"""The refit version protocol: who may touch published tensors, and when.

# Note [Version protocol]
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

A receiver that dies inside a version leaves its count behind; the publisher's ``begin_update``
then fails with TransferTimeout naming the version and count instead of waiting forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from warmlink._backoff import Backoff
from warmlink.errors import TransferTimeout, VersionError
from warmlink.refit._memo import PerStore

__all__ = ["VersionState", "read_state", "write_state", "enter", "leave", "wait_no_readers", "state_key", "manifest_key",
           "last_state"]

# rank -> the VersionState this process last read through a Store object: a new receiver's first
# guess (Note [Warm metadata] in refit._memo). Never trusted: entering reads the state again.
_last_read = PerStore()


def state_key(rank: int) -> str:
    return f"pub/{rank}/state"


def manifest_key(rank: int, generation: int) -> str:
    return f"pub/{rank}/manifest/{generation}"


def readers_key(rank: int, version: int) -> str:
    return f"pub/{rank}/readers/{version}"


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
    store.add(readers_key(rank, expected.version), 1, checked=False)
    now = read_state(store, rank)
    if now == expected:
        return True
    store.add(readers_key(rank, expected.version), -1, checked=False)
    return False


def leave(store, rank: int, version: int) -> None:
    store.add(readers_key(rank, version), -1, checked=False)


def wait_no_readers(store, rank: int, version: int, timeout_s: float) -> None:
    """Block until no receiver reads ``version`` of ``rank``; TransferTimeout after ``timeout_s``."""
    key = readers_key(rank, version)
    backoff = Backoff(timeout_s)
    while (count := store.add(key, 0, checked=False)) > 0:
        if backoff.expired():
            raise TransferTimeout(
                f"Publisher.begin_update: publisher/{rank} version {version} still has {count} reader(s) "
                f"after {timeout_s:.3f} s; a receiver died or stalled mid-pull"
            )
        backoff.sleep()
