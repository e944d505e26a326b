"""Peer mappings: a peer's memory opened in this process (IPC handles, shm files, NIXL agents).

Keyed ``(peer_key, generation, region identity)``. See Note [Peer identity and generation] in
``warmlink.transport.base``. When a slot's generation changes, ``forget_peer`` closes the old
generation's mappings; other peers' stay open. Counted under ``"peer_mapping"``.
"""

from __future__ import annotations

from typing import Callable, Hashable

from warmlink.pool.core import SharedCache

__all__ = ["mapping_cache", "forget_peer", "open_mappings"]

_caches: dict[str, SharedCache] = {}


def mapping_cache(backend: str, create: Callable[[Hashable], object], destroy: Callable[[object], None]) -> SharedCache:
    """The process-wide mapping cache of ``backend``; keys must start with ``(peer_key, generation, ...)``."""
    cache = _caches.get(backend)
    if cache is None:
        cache = _caches[backend] = SharedCache("peer_mapping", create, destroy)
    return cache


def forget_peer(peer_key: str, keep_generation: int | None = None) -> int:
    """Close every cached mapping of ``peer_key`` whose generation is not ``keep_generation``."""
    return sum(
        cache.evict(lambda k: k[0] == peer_key and k[1] != keep_generation) for cache in list(_caches.values())
    )


def open_mappings() -> int:
    """How many mappings the caches hold (churn tests check this does not grow)."""
    return sum(len(cache.keys()) for cache in _caches.values())
