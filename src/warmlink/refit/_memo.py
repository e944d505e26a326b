"""Process-wide memos of refit metadata: small, bounded, thread-safe.

# Note [Warm metadata]
A warm engine lifecycle (create, export or refit once, close, again and again) creates nothing,
so what is left is metadata: store round trips and JSON. Three memos cut it, each under a rule that
keeps metadata from peers validated (DESIGN invariant 3); all are off with pooling off.

* Publisher: an export whose manifest equals the last one this process wrote, for the same rank
  through the same ``Store`` object, keeps that manifest and its generation instead of drawing a new
  generation and writing the manifest again. The stored bytes are read back first (one round trip;
  a manifest past one store value is a blob, read back and checked whole, Note [Blobs] in
  ``rendezvous._blobs``) and must still be exactly what was written. A generation is reused only
  through the ``Store`` object that drew it: another server (a restarted one at the same address)
  may have handed out the same number for other content. Equal manifests name the same process, regions and offsets,
  so receivers holding that generation hold valid mappings.
* Receiver: manifests are always read from the store, but bytes equal to bytes this process has
  already validated are not decoded and validated again (``validated``, keyed by the SHA-256 of
  the exact bytes). Any other bytes are decoded and validated in full.
* Receiver: a new receiver's first sync tries to enter the state this process last read for each
  publisher rank (``last_states``) instead of reading it first, and so does a sync told which
  version to pull (that version, of the generations last read); the state read after entering
  decides, exactly as in Note [Version protocol], and a stale guess only costs a leave and the
  normal path.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["PerStore", "Lru"]


class PerStore:
    """``(store object, key) -> value``; entries go away with their store object.

    Keyed by the ``Store`` object, not its address: a new connection (to a restarted server, say)
    starts empty. Objects that cannot be weakly referenced are never remembered.
    """

    def __init__(self, max_keys_per_store: int = 64) -> None:
        self._by_store: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._max = max_keys_per_store
        self._lock = threading.Lock()

    def get(self, store, key: Hashable):
        with self._lock:
            try:
                entries = self._by_store.get(store)
            except TypeError:
                return None
            return None if entries is None else entries.get(key)

    def put(self, store, key: Hashable, value) -> None:
        with self._lock:
            try:
                entries = self._by_store.get(store)
                if entries is None:
                    entries = self._by_store[store] = OrderedDict()
            except TypeError:
                return
            entries[key] = value
            entries.move_to_end(key)
            while len(entries) > self._max:
                entries.popitem(last=False)

    def pop(self, store, key: Hashable):
        """Take ``key``'s value out (None when absent)."""
        with self._lock:
            try:
                entries = self._by_store.get(store)
            except TypeError:
                return None
            return None if entries is None else entries.pop(key, None)

    def drain(self) -> list:
        """Take every value out, of every store."""
        with self._lock:
            values = [v for entries in self._by_store.values() for v in entries.values()]
            self._by_store.clear()
        return values


class Lru:
    """A bounded ``key -> value`` map; the least recently used entry goes first."""

    def __init__(self, max_entries: int) -> None:
        self._entries: OrderedDict = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    def get(self, key: Hashable):
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
