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


class BackendUnavailable(WarmlinkError, ImportError):
    """A transport backend was asked for but cannot load on this machine."""


class PoolError(WarmlinkError):
    """A pooled resource could not be created, reset or returned."""


class VersionError(WarmlinkError):
    """The refit version protocol was used out of order (e.g. publish without begin_update)."""
