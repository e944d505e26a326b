"""A closed receiver's warm state, kept for the next receiver with the same settings.

# Note [Parked receive state]
A test suite that builds an engine per test closes a receiver and creates the same one again a
moment later. Returning its link, receive buffers and opened mappings to their pools and taking
them again costs little each, but together they were most of a warm lifecycle's alloc and
register phases: buffer views, a copy batch validated and coalesced again, regions re-opened.
So a receiver whose last cycle succeeded parks what it holds (link lease, sources with their
opened regions, plan, buffers and prepared batch) on ``close()``, and the next receiver whose key
matches exactly adopts it. The key holds everything those objects depend on: the ``Store``
object, number of publishers, device, backend, install mode, run cap, name map and every
declared layout in order. Targets are not in it: "copy" install copies into the new receiver's
own targets, and "swap" (whose targets point into the buffers) never parks.

Nothing is trusted more than before: the adopting receiver re-reads every manifest on its first
sync (``SourceSet.unverify``) and anything that changed is rebuilt as for a new publisher
generation. One state is parked per process; parking another, or ``release_parked()``, releases
the old one to the pools. Off with pooling off.
"""

from __future__ import annotations

import threading

__all__ = ["ParkedState", "park", "adopt", "release_parked"]


class ParkedState:
    """What a receiver held; ``release`` gives it all back (idempotent)."""

    __slots__ = ("key", "link_lease", "sources", "plans", "buffers", "_released")

    def __init__(self, key: tuple, link_lease, sources, plans: dict, buffers: dict) -> None:
        self.key = key
        self.link_lease = link_lease
        self.sources = sources
        self.plans = plans
        self.buffers = buffers
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        link = self.link_lease.resource
        for bufs in self.buffers.values():
            link.release(bufs.region)
        self.buffers.clear()
        self.sources.close_regions()
        self.link_lease.release()

    def __repr__(self) -> str:
        return f"ParkedState(buffers={len(self.buffers)}, released={self._released})"


_lock = threading.Lock()
_slot: list[ParkedState | None] = [None]


def park(state: ParkedState) -> None:
    """Keep ``state`` for the next matching receiver; the state parked before is released."""
    with _lock:
        old, _slot[0] = _slot[0], state
    if old is not None:
        old.release()


def adopt(key: tuple) -> ParkedState | None:
    """Take the parked state if its key equals ``key`` exactly; None otherwise (it stays parked)."""
    with _lock:
        state = _slot[0]
        if state is None or state.key != key:
            return None
        _slot[0] = None
    return state


def release_parked() -> None:
    """Release the parked state, if any, to the pools (tests; processes trimming memory)."""
    with _lock:
        old, _slot[0] = _slot[0], None
    if old is not None:
        old.release()
