"""The one error hierarchy of warmlink.

Every failure the library can explain is a ``WarmlinkError`` subclass, raised before any byte moves
where the input is at fault. Messages follow ``"{func}: {field}={value!r} {problem}; expected ..."``
and name the peer, rank and tensor where known.
"""

from __future__ import annotations

__all__ = [
    "WarmlinkError",
    "ConfigError",
    "MetadataError",
    "LayoutError",
    "PeerLostError",
    "TransferTimeout",
    "TransferError",
    "BackendUnavailable",
    "PoolError",
    "VersionError",
    "SlowTransportError",
    "SlowTransportWarning",
]


class WarmlinkError(Exception):
    """Base class of every error warmlink raises on purpose."""


class ConfigError(WarmlinkError, ValueError):
    """A constructor argument or a ``WARMLINK_*`` environment variable is invalid."""


class MetadataError(WarmlinkError, ValueError):
    """A payload read from the rendezvous store (or built for it) fails validation."""


class LayoutError(WarmlinkError, ValueError):
    """Shapes, dtypes or shardings of the two sides cannot be matched."""


class PeerLostError(WarmlinkError):
    """A peer process died or left while this process depended on it."""


class TransferTimeout(WarmlinkError, TimeoutError):
    """A transfer, store wait or handshake did not complete within its timeout."""


class TransferError(WarmlinkError):
    """The transport reported a failure while moving bytes."""


class SlowTransportError(TransferError):
    """Bytes moved far below what the path should give (a transport fell back, e.g. UCX to TCP),
    and the link was told to fail rather than warn."""


class BackendUnavailable(WarmlinkError, ImportError):
    """A transport backend was asked for but cannot load on this machine."""


class PoolError(WarmlinkError):
    """A pooled resource could not be created, reset or returned."""


class VersionError(WarmlinkError):
    """The refit version protocol was used out of order (e.g. publish without begin_update)."""


class SlowTransportWarning(UserWarning):
    """Bytes moved far below what the path should give: a transport probably fell back (e.g. UCX
    chose TCP where CUDA IPC was expected). The message says why it may have happened."""
