"""Peer mappings: a peer's memory opened in this process (IPC handles, shm files, NIXL agents).

Keyed ``(peer_key, peer process, region identity, ...)``. See Note [Peer identity and generation]
in ``warmlink.transport.base``. When a slot's process changes, ``forget_peer`` closes the old
process's mappings; other peers' stay open. Counted under ``"peer_mapping"``.
"""

from __future__ import annotations

from typing import Callable, Hashable

from warmlink.pool.core import SharedCache

__all__ = ["mapping_cache", "forget_peer", "open_mappings"]

_caches: dict[str, SharedCache] = {}


def mapping_cache(backend: str, create: Callable[[Hashable], object], destroy: Callable[[object], None]) -> SharedCache:
    """The process-wide mapping cache of ``backend``; keys are ``(peer_key, process_id, region_id, ...)``."""
    cache = _caches.get(backend)
    if cache is None:
        cache = _caches[backend] = SharedCache("peer_mapping", create, destroy)
    return cache


def forget_peer(peer_key: str, keep_process: str | None = None, keep_regions=None) -> int:
    """Close cached mappings of ``peer_key`` except those of ``keep_process`` whose region (key[2])
    is in ``keep_regions`` (every region of it when None). Returns how many were removed."""

    def stale(k) -> bool:
        if k[0] != peer_key:
            return False
        return k[1] != keep_process or (keep_regions is not None and k[2] not in keep_regions)

    return sum(cache.evict(stale) for cache in list(_caches.values()))


def open_mappings() -> int:
    """How many mappings the caches hold (churn tests check this does not grow)."""
    return sum(len(cache.keys()) for cache in _caches.values())
