"""Transports: one ``Link`` interface, backends imported by name only when selected."""

from __future__ import annotations

from warmlink.transport.base import Batch, Copy, Link, LocalRegion, PeerRef, RemoteRegion, Transfer

__all__ = ["Link", "Copy", "Batch", "Transfer", "LocalRegion", "RemoteRegion", "PeerRef", "open_link", "BACKENDS"]

BACKENDS = ("shm", "cuda_ipc")


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


def open_link(backend: str | None, device: int, timeout_s: float) -> Link:
    """A Link of ``backend`` for ``device`` (-1 = host). Imports the backend module on first use.

    Raises:
        ConfigError: unknown backend, or a backend that does not fit the device.
        BackendUnavailable: the backend cannot load here (e.g. no CUDA).
    """
    from warmlink.errors import BackendUnavailable

    name = resolve_backend(backend, device)
    if name == "shm":
        from warmlink.transport.shm import ShmLink

        return ShmLink(timeout_s, device)
    try:
        from warmlink.transport.cuda_ipc import CudaIpcLink
    except ImportError as exc:
        raise BackendUnavailable(f"open_link: backend='cuda_ipc' cannot load: {exc}; install warmlink[cuda]") from exc
    return CudaIpcLink(device, timeout_s)
