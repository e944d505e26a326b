"""Rendezvous: a key-value store carrying versioned, validated JSON metadata.

``import warmlink.rendezvous`` (and ``warmlink.rendezvous.schema``) imports no torch;
``Store`` loads ``torch.distributed`` on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from warmlink.rendezvous.schema import (
    SCHEMA_VERSION,
    decode,
    encode,
    validate_peer_info,
    validate_publisher_manifest,
    validate_region,
    validate_socket_address,
    validate_version_state,
)

if TYPE_CHECKING:
    from warmlink.rendezvous.store import Store

__all__ = [
    "Store",
    "SCHEMA_VERSION",
    "decode",
    "encode",
    "validate_peer_info",
    "validate_publisher_manifest",
    "validate_region",
    "validate_socket_address",
    "validate_version_state",
]


def __getattr__(name: str) -> Any:
    if name == "Store":
        from warmlink.rendezvous.store import Store

        return Store
    raise AttributeError(f"module 'warmlink.rendezvous' has no attribute {name!r}")
