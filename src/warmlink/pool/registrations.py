"""Registration caches: exports of local memory (IPC handles, shm names, NIXL registrations).

A registration is keyed by everything that identifies the *allocation*, never the address alone:
``(backend, device, base address, allocation id)``. CUDA gives every ``cudaMalloc`` a unique
buffer id (``CU_POINTER_ATTRIBUTE_BUFFER_ID``), so memory freed and re-allocated at the same address
gets a new key and never a stale handle. Each backend makes one cache here and counts under
``"registration"`` in ``pool.stats()``.
"""

from __future__ import annotations

from typing import Callable, Hashable

from warmlink.pool.core import SharedCache

__all__ = ["registration_cache"]

_caches: dict[str, SharedCache] = {}


def registration_cache(backend: str, create: Callable[[Hashable], object], destroy: Callable[[object], None]) -> SharedCache:
    """The process-wide registration cache of ``backend`` (made on first call)."""
    cache = _caches.get(backend)
    if cache is None:
        cache = _caches[backend] = SharedCache("registration", create, destroy)
    return cache
