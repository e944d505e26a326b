"""The process-wide warm pool: counters, exclusive free lists, shared keyed caches and memos.

Three shapes of pooled resource exist:

* ``FreeList``: resources one user holds at a time (streams, events, arenas). ``lease(key)`` hands
  out an idle one or creates it; ``release`` resets it and keeps it, or destroys it when the reset
  fails. See Note [Reset before reuse].
* ``SharedCache``: resources many users share by key (registrations, opened peer mappings), and
  values worth computing once (refit plans, layout signatures). ``acquire(key)`` returns the
  cached one or creates it; ``get(key)`` is acquire and release at once, for values with nothing to
  free. Entries are dropped explicitly (``evict``), e.g. when a peer's generation changes, or past
  ``max_entries``, least recently used first.
* ``PerOwner``: values learned through one owner object (a store connection) and remembered for
  as long as it lives: a state read, a manifest written, a board parked for a successor.
  ``get`` / ``take`` find what ``put`` left. See Note [Owner memos].

With pooling off (``WARMLINK_POOL=0`` or ``set_enabled(False)``) every lease creates and every
release destroys, and caches hand out private entries destroyed on release: the A/B baseline.
A cache built on these classes follows the switch without reading it. A pool that wraps
resources other kinds already count (a refit receiver's state, its buffers) passes
``counted=False``: it stays out of ``stats()`` instead of counting them twice.

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
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

from warmlink import _env
from warmlink.errors import ConfigError, PoolError, WarmlinkError

__all__ = ["enabled", "set_enabled", "stats", "reset_stats", "Counters", "FreeList", "SharedCache", "PerOwner", "Lease"]

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


def _counters_for(kind: str, counted: bool) -> Counters:
    """``kind``'s counters in ``stats()``, or private ones that nothing reports (``counted=False``)."""
    return counters(kind) if counted else Counters()


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

    def discard(self) -> None:
        """Destroy the resource instead of giving it back: its holder knows it must serve no one
        else (its last use failed, or it is bound to this holder). No reset, no failed reset
        counted. Safe to call twice, or after ``release``."""
        if not self._released:
            self._released = True
            self._pool._destroy_one(self.resource)

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
        counted: False keeps ``kind`` out of ``stats()`` (resources made of ones other kinds count).
    """

    def __init__(
        self,
        kind: str,
        create: Callable[[K], R],
        reset: Callable[[R], bool],
        destroy: Callable[[R], None],
        max_idle_per_key: int = 64,
        max_idle_total: int = 256,
        *,
        counted: bool = True,
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
        self._counters = _counters_for(kind, counted)

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
    """Resources or values shared by key (registrations, opened peer mappings, plans), made once.

    ``acquire`` returns ``(resource, token)``; ``release(token)`` drops the reference. With pooling
    on, entries stay cached at zero references until ``evict`` or, past ``max_entries``, until
    they are the least recently acquired; with pooling off, every acquire creates a private entry
    that ``release`` destroys. An entry removed while held is destroyed by its last release.

    Args:
        kind: name in ``stats()``.
        create: makes the resource for a key. ``acquire``, ``get`` and ``preload`` may pass their
            own, for resources whose making needs more than the key (a plan needs the layouts its
            signature names); the key must still determine the resource.
        destroy: frees a resource for good; default: nothing to free (computed values).
        max_entries: entries kept; None: no bound.
        counted: False keeps ``kind`` out of ``stats()``.
    """

    def __init__(
        self,
        kind: str,
        create: Callable[[K], R] | None = None,
        destroy: Callable[[R], None] | None = None,
        *,
        max_entries: int | None = None,
        counted: bool = True,
    ) -> None:
        if max_entries is not None and max_entries < 1:
            raise ConfigError(f"SharedCache({kind!r}): max_entries={max_entries!r}; expected None or an int >= 1")
        self.kind = kind
        self._create = create
        self._destroy = destroy if destroy is not None else _nothing_to_free
        self._max = max_entries
        self._entries: OrderedDict[K, _Entry[R]] = OrderedDict()  # least recently acquired first
        self._lock = threading.Lock()
        self._counters = _counters_for(kind, counted)

    def acquire(self, key: K, create: Callable[[K], R] | None = None) -> tuple[R, object]:
        """The resource for ``key`` and a token to ``release``; created on first use (by
        ``create`` when given, else by the cache's own)."""
        if enabled():
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.refs += 1
                    self._entries.move_to_end(key)
                    self._counters.reused += 1
                    return entry.resource, (key, entry)
        entry = self._make(key, create)
        if not enabled():
            return entry.resource, (key, entry)
        with self._lock:
            raced = self._entries.get(key)
            if raced is None:
                self._entries[key] = entry
                overflow = []
                while self._max is not None and len(self._entries) > self._max:
                    overflow.append(self._entries.popitem(last=False)[1])
                # decided under the lock, as in evict: a held entry goes at its last release
                idle = [e for e in overflow if e.refs <= 0]
            else:
                raced.refs += 1
        if raced is not None:
            # Another thread created the same key first: keep theirs, destroy ours.
            self._destroy_entry(entry)
            return raced.resource, (key, raced)
        for old in idle:
            self._destroy_entry(old)
        return entry.resource, (key, entry)

    def get(self, key: K, create: Callable[[K], R] | None = None) -> R:
        """The value for ``key``, made on first use, holding no reference: for caches of values
        with nothing to free (plans, signatures). With pooling off it is made every time."""
        if enabled():
            with self._lock:  # a hit takes no reference, so it needs no release either
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self._counters.reused += 1
                    return entry.resource
        resource, token = self.acquire(key, create)
        self.release(token)
        return resource

    def preload(self, key: K, create: Callable[[K], R] | None = None) -> R | None:
        """Make the entry for ``key`` now, if missing, and keep it unheld so that a later
        ``acquire`` finds it (a cycle that allocates anyway allocates what the next one needs).
        Counts nothing when cached. With pooling off, makes nothing and returns None: an entry
        nobody holds would be destroyed at once."""
        if not enabled():
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry.resource
        return self.get(key, create)

    def _make(self, key: K, create: Callable[[K], R] | None) -> _Entry[R]:
        make = create if create is not None else self._create
        if make is None:
            raise ConfigError(f"SharedCache({self.kind!r}).acquire: no create for key={key!r}; pass create= here "
                              "or to the constructor")
        start = time.perf_counter()
        try:
            resource = make(key)
        except Exception as exc:
            if isinstance(exc, PoolError) or getattr(exc, "__module__", "").startswith("warmlink"):
                raise
            raise PoolError(f"{self.kind}: create(key={key!r}) failed: {exc}") from exc
        with _lock:
            self._counters.created += 1
            self._counters.live += 1
            self._counters.create_s += time.perf_counter() - start
        return _Entry(resource, refs=1)

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

    def values(self) -> list[R]:
        """The cached resources now (held or idle), for reporting what a cache holds."""
        with self._lock:
            return [entry.resource for entry in self._entries.values()]

    def _destroy_entry(self, entry: _Entry[R]) -> None:
        try:
            self._destroy(entry.resource)
        except Exception as exc:
            log.warning("pool destroy failed", extra={"kind": self.kind, "error": str(exc)})
        with _lock:
            self._counters.destroyed += 1
            self._counters.live -= 1

    def clear(self) -> None:
        """Remove every entry; those nobody holds are destroyed now, held ones at their last release."""
        self.evict(lambda _k: True)


# Note [Owner memos]
# Some values are learned through an object rather than made from a key: the version state read
# through a store connection, the manifest written through it, the board a closed publisher left
# for its successor. A ``SharedCache`` fits neither half of that: it makes values from keys (these
# are put, found or taken), and it holds its keys, which would keep every store connection alive
# for as long as a value about it is remembered. ``PerOwner`` holds its owners weakly: an owner's
# values go when it does (a new connection, to a restarted server say, starts empty), and objects
# that cannot be weakly referenced are never remembered. With pooling off it remembers nothing:
# ``put`` drops (destroys) its value at once, ``get`` and ``take`` find nothing.
#
# Counted as ``kind`` in ``stats()``: ``created`` an entry made (a key remembered that was not, or
# any put with pooling off), ``reused`` a lookup answered (a taken entry leaves with its taker),
# ``destroyed`` an entry the memo dropped (past the bound, cleared, or at once with pooling off).
# Replacing a remembered value makes no entry. ``live`` and ``idle`` stay 0: an entry lasts as
# long as its owner, whose end is a garbage collection away and not the memo's to count, so a
# count of entries would move with the collector rather than with anything the memo did.


class PerOwner(Generic[R]):
    """``(owner object, key) -> value``, weak on the owner, bounded per owner (Note [Owner memos]).

    Args:
        kind: name in ``stats()``.
        destroy: frees a value the memo drops (past the bound, replaced, cleared, or put with
            pooling off); default: nothing to free. Values of an owner that goes are dropped
            unfreed, with it: freeing them would run inside whatever the collector interrupted.
        max_keys_per_owner: entries kept per owner; past it the least recently put goes first.
        counted: False keeps ``kind`` out of ``stats()``.
        pooled: False for state that must be kept whatever the switch says (a reader slot is
            this process's identity at a publisher, not a cache): remembered with pooling off too.
    """

    def __init__(self, kind: str, *, destroy: Callable[[R], None] | None = None, max_keys_per_owner: int = 64,
                 counted: bool = True, pooled: bool = True) -> None:
        if max_keys_per_owner < 1:
            raise ConfigError(f"PerOwner({kind!r}): max_keys_per_owner={max_keys_per_owner!r}; expected an int >= 1")
        self.kind = kind
        self._destroy = destroy if destroy is not None else _nothing_to_free
        self._max = max_keys_per_owner
        self._pooled = pooled
        self._by_owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._counters = _counters_for(kind, counted)

    def _remembers(self) -> bool:
        return enabled() or not self._pooled

    def get(self, owner: object, key: Hashable) -> R | None:
        """The value remembered for ``(owner, key)``, or None (always None with pooling off)."""
        if not self._remembers():
            return None
        with self._lock:
            entries = self._entries(owner, make=False)
            value = None if entries is None else entries.get(key)
        if value is not None:
            self._count(reused=1)
        return value

    def put(self, owner: object, key: Hashable, value: R) -> None:
        """Remember ``value`` for ``(owner, key)``, dropping (destroying) the value it replaces."""
        replaced, evicted = [], []
        created = remembered = False
        if self._remembers():
            with self._lock:
                entries = self._entries(owner, make=True)
                if entries is not None:
                    remembered = True
                    old = entries.get(key)
                    created = old is None
                    if old is not None and old is not value:
                        replaced.append(old)
                    entries[key] = value
                    entries.move_to_end(key)
                    while len(entries) > self._max:
                        evicted.append(entries.popitem(last=False)[1])
        if remembered:
            self._count(created=int(created), destroyed=len(evicted))
        else:  # made and forgotten at once
            self._count(created=1, destroyed=1)
            evicted.append(value)
        for v in replaced + evicted:
            self._drop(v)

    def take(self, owner: object, key: Hashable) -> R | None:
        """Take the value remembered for ``(owner, key)`` out (None when absent or pooling is off)."""
        if not self._remembers():
            return None
        with self._lock:
            entries = self._entries(owner, make=False)
            value = None if entries is None else entries.pop(key, None)
        if value is not None:
            self._count(reused=1)
        return value

    def clear(self) -> None:
        """Forget every value of every owner, destroying each."""
        with self._lock:
            values = [v for entries in self._by_owner.values() for v in entries.values()]
            self._by_owner.clear()
        self._count(destroyed=len(values))
        for v in values:
            self._drop(v)

    def _entries(self, owner: object, *, make: bool) -> OrderedDict | None:
        """``owner``'s entries (lock held); None when it has none and ``make`` is False, or when
        it cannot be weakly referenced (never remembered)."""
        try:
            entries = self._by_owner.get(owner)
            if entries is None and make:
                entries = self._by_owner[owner] = OrderedDict()
        except TypeError:
            return None
        return entries

    def _count(self, *, created: int = 0, reused: int = 0, destroyed: int = 0) -> None:
        with _lock:
            c = self._counters
            c.created += created
            c.reused += reused
            c.destroyed += destroyed

    def _drop(self, value: R) -> None:
        try:
            self._destroy(value)
        except Exception as exc:
            log.warning("pool destroy failed", extra={"kind": self.kind, "error": str(exc)})


def _nothing_to_free(_resource: object) -> None:
    pass
