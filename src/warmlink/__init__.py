"""warmlink: move tensors between GPU processes with the setup paid once.

Importing warmlink creates no CUDA context, store or process group and imports no optional
library. Subpackages: ``pool``, ``transport``, ``rendezvous``, ``refit``.
"""

from warmlink.errors import (
    BackendUnavailable,
    ConfigError,
    LayoutError,
    MetadataError,
    PeerLostError,
    PoolError,
    TransferError,
    TransferTimeout,
    VersionError,
    WarmlinkError,
)

__version__ = "0.1.0"

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
    "__version__",
]
