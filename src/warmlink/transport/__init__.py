"""Transports: one ``Link`` interface, backends imported by name only when selected."""

from __future__ import annotations

from warmlink.transport.base import Batch, Copy, Link, LocalRegion, PeerRef, RemoteRegion, Transfer

__all__ = ["Link", "Copy", "Batch", "Transfer", "LocalRegion", "RemoteRegion", "PeerRef", "open_link", "lease_link",
           "BACKENDS"]

BACKENDS = ("shm", "cuda_ipc", "nixl")


def resolve_backend(backend: str | None, device: int) -> str:
    """``auto`` -> ``cuda_ipc`` for a CUDA device, ``shm`` for the host. Argument > env > auto."""
    from warmlink import _env
    from warmlink.errors import ConfigError

    name = backend if backend is not None else _env.default_backend()
    if name == "auto":
        name = "cuda_ipc" if device >= 0 else "shm"
    if name not in BACKENDS:
        raise ConfigError(f"open_link: backend={name!r} is unknown; expected one of {list(BACKENDS)} or 'auto'")
    return name


def open_link(backend: str | None, device: int, timeout_s: float, **options) -> Link:
    """A new, unpooled Link of ``backend`` for ``device`` (-1 = host); the caller closes it.

    Engines use ``lease_link`` instead. Imports the backend module on first use.

    Raises:
        ConfigError: unknown backend, or a backend that does not fit the device.
        BackendUnavailable: the backend cannot load here (e.g. no CUDA).
    """
    return _construct(resolve_backend(backend, device), device, timeout_s, options)


# Transport endpoints are the costliest objects an engine holds (a NIXL agent took 1.18 s to
# create on the H200 machine; a cuda_ipc link holds streams and events, an shm link a thread), so
# engines lease them. The key holds every setting that changes a link's behaviour; the timeout is
# set per lease. See Note [Reset before reuse] in warmlink.pool.core.
def _create_link(key: tuple) -> Link:
    name, device, options = key
    return _construct(name, device, 60.0, dict(options))


def _construct(name: str, device: int, timeout_s: float, options: dict) -> Link:
    from warmlink.errors import BackendUnavailable

    if name == "shm":
        from warmlink.transport.shm import ShmLink

        return ShmLink(timeout_s, device, **options)
    if name == "nixl":
        # Importing the module imports no NIXL; the constructor does (BackendUnavailable if missing).
        from warmlink.transport.nixl import NixlLink

        return NixlLink(device, timeout_s, **options)
    try:
        from warmlink.transport.cuda_ipc import CudaIpcLink
    except ImportError as exc:
        raise BackendUnavailable(f"open_link: backend='cuda_ipc' cannot load: {exc}; install warmlink[cuda]") from exc
    return CudaIpcLink(device, timeout_s, **options)


def _links():
    from warmlink.pool.core import FreeList

    global _LINKS
    if _LINKS is None:
        _LINKS = FreeList("link", _create_link, lambda link: link.recycle(), lambda link: link.close(), max_idle_per_key=4)
    return _LINKS


_LINKS = None


def lease_link(backend: str | None, device: int, timeout_s: float, **options):
    """A pooled Link (``Lease``; ``release()`` recycles it) of ``backend`` for ``device``.

    Args:
        backend: ``"shm"``, ``"cuda_ipc"``, ``"auto"`` or None (``WARMLINK_BACKEND``).
        device: CUDA device index, or -1 for host memory.
        timeout_s: the link's default transfer timeout for this lease, seconds.
        **options: backend settings (``copy_method``, ``peer_access``, ``num_streams``); part of
            the pool key, so a lease never receives a link built with other settings.

    Warm path? A pool hit costs a dict lookup; a miss builds the link (imports, streams, events).
    """
    name = resolve_backend(backend, device)
    lease = _links().lease((name, device, tuple(sorted(options.items()))))
    lease.resource.timeout_s = timeout_s
    return lease
