"""The process-wide warm pool: counters, exclusive free lists and shared keyed caches.

Two shapes of pooled resource exist:

* ``FreeList``: resources one user holds at a time (streams, events, arenas). ``lease(key)`` hands
  out an idle one or creates it; ``release`` resets it and keeps it, or destroys it when the reset
  fails. See Note [Reset before reuse].
* ``SharedCache``: resources many users share by key (registrations, opened peer mappings).
  ``acquire(key)`` returns the cached one or creates it; entries are dropped explicitly
  (``evict``), e.g. when a peer's generation changes.

With pooling off (``WARMLINK_POOL=0`` or ``set_enabled(False)``) every lease creates and every
release destroys, and caches hand out private entries destroyed on release: the A/B baseline.

# Note [Reset before reuse]
A resource goes back on a free list only after its ``reset`` returned True (stream drained and
idle, event complete, arena generation bumped). A reset that returns False or raises means the
resource may be broken: it is destroyed and counted in ``failed_resets``, and never handed out.
The key of a free list holds every setting that makes two resources different, so a lease never
receives a resource created with other settings.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

from warmlink import _env
from warmlink.errors import PoolError, WarmlinkError

__all__ = ["enabled", "set_enabled", "stats", "reset_stats", "Counters", "FreeList", "SharedCache", "Lease"]

log = logging.getLogger("warmlink.pool")

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

_lock = threading.RLock()
_override: bool | None = None
_counters: dict[str, "Counters"] = {}


def enabled() -> bool:
    """Whether pooling is on: ``set_enabled`` override > ``WARMLINK_POOL`` > on."""
    return _override if _override is not None else _env.pool_enabled()


def set_enabled(value: bool | None) -> None:
    """Override ``WARMLINK_POOL`` for this process (``None`` returns to the environment).

    Resources already idle in the pool stay there; turning pooling off only changes what later
    leases and releases do. Benchmarks use this to run pool on and pool off in one process.
    """
    global _override
    _override = value


@dataclass
class Counters:
    """What one kind of resource cost this process. Times in seconds."""

    created: int = 0
    reused: int = 0
    destroyed: int = 0
    failed_resets: int = 0
    create_s: float = 0.0
    live: int = 0
    idle: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def counters(kind: str) -> Counters:
    with _lock:
        c = _counters.get(kind)
        if c is None:
            c = _counters[kind] = Counters()
        return c


def stats() -> dict[str, dict]:
    """A snapshot of every kind's counters: ``{kind: {created, reused, destroyed, ...}}``."""
    with _lock:
        return {kind: c.as_dict() for kind, c in sorted(_counters.items())}


def reset_stats() -> None:
    """Zero the event counters (created, reused, destroyed, failed_resets, create_s); live and idle stay."""
    with _lock:
        for c in _counters.values():
            c.created = c.reused = c.destroyed = c.failed_resets = 0
            c.create_s = 0.0


class Lease(Generic[R]):
    """One resource held from a ``FreeList``; a context manager that releases on exit."""

    __slots__ = ("resource", "key", "_pool", "_released")

    def __init__(self, pool: "FreeList", key, resource: R) -> None:
        self.resource = resource
        self.key = key
        self._pool = pool
        self._released = False

    def release(self) -> None:
        """Give the resource back (reset, then kept or destroyed). Safe to call twice."""
        if not self._released:
            self._released = True
            self._pool._give_back(self.key, self.resource)

    def __enter__(self) -> R:
        return self.resource

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({self._pool.kind}, key={self.key!r}, released={self._released})"


class FreeList(Generic[K, R]):
    """Exclusive leases of resources keyed by everything that makes them differ.

    Args:
        kind: name in ``stats()`` (``"stream"``, ``"arena"``...).
        create: makes a resource for a key (the expensive call).
        reset: makes a returned resource ready for the next user; returns False if it cannot.
        destroy: frees a resource for good.
        max_idle_per_key: idle resources kept per key.
        max_idle_total: idle resources kept across all keys. Past either bound the oldest idle
            resource is destroyed, so the pool never grows without bound however many distinct
            keys (arena sizes, settings) its users ask for.
    """

    def __init__(
        self,
        kind: str,
        create: Callable[[K], R],
        reset: Callable[[R], bool],
        destroy: Callable[[R], None],
        max_idle_per_key: int = 64,
        max_idle_total: int = 256,
    ) -> None:
        self.kind = kind
        self._create = create
        self._reset = reset
        self._destroy = destroy
        self._max_idle = max_idle_per_key
        self._max_idle_total = max_idle_total
        self._idle: dict[K, list[tuple[int, R]]] = {}  # oldest first; (release sequence, resource)
        self._num_idle = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._counters = counters(kind)

    def lease(self, key: K) -> Lease[R]:
        """An idle resource for ``key`` or a new one. Thread-safe."""
        if enabled():
            with self._lock:
                idle = self._idle.get(key)
                if idle:
                    _, resource = idle.pop()
                    if not idle:
                        del self._idle[key]  # keys without idle resources are not kept either
                    self._num_idle -= 1
                    self._counters.reused += 1
                    self._counters.idle -= 1
                    return Lease(self, key, resource)
        start = time.perf_counter()
        try:
            resource = self._create(key)
        except Exception as exc:
            if isinstance(exc, WarmlinkError):  # typed errors (ConfigError for a bad key) stay typed
                raise
            raise PoolError(f"{self.kind}: create(key={key!r}) failed: {exc}") from exc
        with _lock:
            self._counters.created += 1
            self._counters.live += 1
            self._counters.create_s += time.perf_counter() - start
        return Lease(self, key, resource)

    def _give_back(self, key: K, resource: R) -> None:
        if enabled():
            try:
                ok = bool(self._reset(resource))
            except Exception as exc:  # a broken resource is destroyed, never cached
                log.warning("pool reset failed", extra={"kind": self.kind, "key": key, "error": str(exc)})
                ok = False
            if not ok:
                with _lock:
                    self._counters.failed_resets += 1
            else:
                with self._lock:
                    self._seq += 1
                    self._idle.setdefault(key, []).append((self._seq, resource))
                    self._num_idle += 1
                    self._counters.idle += 1
                    # Full: drop the oldest idle one and keep this one, the most recently used,
                    # whose peers' mappings and caches are the likeliest to be warm.
                    evicted = []
                    if len(self._idle[key]) > self._max_idle:
                        evicted.append(self._pop_oldest(key))
                    while self._num_idle > self._max_idle_total:
                        evicted.append(self._pop_oldest(min(self._idle, key=lambda k: self._idle[k][0][0])))
                for old in evicted:
                    self._destroy_one(old)
                return
        self._destroy_one(resource)

    def _destroy_one(self, resource: R) -> None:
        try:
            self._destroy(resource)
        except Exception as exc:
            log.warning("pool destroy failed", extra={"kind": self.kind, "error": str(exc)})
        with _lock:
            self._counters.destroyed += 1
            self._counters.live -= 1

    def _pop_oldest(self, key: K) -> R:
        """Remove and return the oldest idle resource of ``key`` (lock held)."""
        idle = self._idle[key]
        _, resource = idle.pop(0)
        if not idle:
            del self._idle[key]
        self._num_idle -= 1
        self._counters.idle -= 1
        return resource

    def num_idle(self) -> int:
        with self._lock:
            return self._num_idle

    def clear(self) -> None:
        """Destroy every idle resource (leased ones are untouched)."""
        with self._lock:
            idle, self._idle = self._idle, {}
            self._counters.idle -= self._num_idle
            self._num_idle = 0
        for resources in idle.values():
            for _, r in resources:
                self._destroy_one(r)


@dataclass
class _Entry(Generic[R]):
    resource: R
    refs: int = 0
    meta: dict = field(default_factory=dict)


class SharedCache(Generic[K, R]):
    """Resources shared by key (registrations, opened peer mappings), created once.

    ``acquire`` returns ``(resource, token)``; ``release(token)`` drops the reference. With pooling
    on, entries stay cached at zero references until ``evict``; with pooling off, every acquire
    creates a private entry that ``release`` destroys.
    """

    def __init__(self, kind: str, create: Callable[[K], R], destroy: Callable[[R], None]) -> None:
        self.kind = kind
        self._create = create
        self._destroy = destroy
        self._entries: dict[K, _Entry[R]] = {}
        self._lock = threading.Lock()
        self._counters = counters(kind)

    def acquire(self, key: K) -> tuple[R, object]:
        """The resource for ``key`` and a token to ``release``; created on first use."""
        if enabled():
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.refs += 1
                    self._counters.reused += 1
                    return entry.resource, (key, entry)
        start = time.perf_counter()
        try:
            resource = self._create(key)
        except Exception as exc:
            if isinstance(exc, PoolError) or getattr(exc, "__module__", "").startswith("warmlink"):
                raise
            raise PoolError(f"{self.kind}: create(key={key!r}) failed: {exc}") from exc
        entry = _Entry(resource, refs=1)
        with _lock:
            self._counters.created += 1
            self._counters.live += 1
            self._counters.create_s += time.perf_counter() - start
        if not enabled():
            return resource, (key, entry)
        with self._lock:
            raced = self._entries.get(key)
            if raced is None:
                self._entries[key] = entry
                return resource, (key, entry)
            raced.refs += 1
        # Another thread created the same key first: keep theirs, destroy ours.
        self._destroy_entry(entry)
        return raced.resource, (key, raced)

    def release(self, token: object) -> None:
        """Drop one reference; destroys the entry when it is private (pooling off) or evicted."""
        key, entry = token  # type: ignore[misc]
        with self._lock:
            entry.refs -= 1
            cached = self._entries.get(key) is entry
            drop = not cached and entry.refs <= 0
        if drop:
            self._destroy_entry(entry)

    def evict(self, predicate: Callable[[K], bool]) -> int:
        """Remove entries whose key matches; destroy those nobody holds. Returns how many removed."""
        with self._lock:
            keys = [k for k in self._entries if predicate(k)]
            removed = [self._entries.pop(k) for k in keys]
            # decided under the lock: an entry still held is destroyed by its last release, which
            # sees it gone; reading refs after the lock raced that release into a double destroy
            idle = [entry for entry in removed if entry.refs <= 0]
        for entry in idle:
            self._destroy_entry(entry)
        return len(removed)

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._entries)

    def _destroy_entry(self, entry: _Entry[R]) -> None:
        try:
            self._destroy(entry.resource)
        except Exception as exc:
            log.warning("pool destroy failed", extra={"kind": self.kind, "error": str(exc)})
        with _lock:
            self._counters.destroyed += 1
            self._counters.live -= 1

    def clear(self) -> None:
        self.evict(lambda _k: True)
