"""The ``ep_rank`` payload: what one rank of an ep group tells its peers, validated on arrival.

::

    {"schema_version": 1, "kind": "ep_rank",
     "peer": <peer_info payload, role "ep">,
     "config": {"num_ranks": R, "max_tokens": T, "hidden": H, "num_topk": K},
     "data": <region: the rank's ep region>, "mailbox": <region: its shm mailbox>}

No event handles: peers learn that bytes landed from arrival flags in the mailbox segment
(ep.wire.flags, Note [Arrival flags]), never by opening each other's events.

A peer whose config differs from this rank's is refused with a ``ConfigError`` naming the field:
regions laid out differently would put bytes in the wrong place.
"""

from __future__ import annotations

from typing import Any

from warmlink.errors import ConfigError, MetadataError
from warmlink.rendezvous import schema

__all__ = ["CONFIG_KEYS", "KIND", "check_config", "validate_ep_rank", "validate_rank_header"]

KIND = "ep_rank"
CONFIG_KEYS = ("num_ranks", "max_tokens", "hidden", "num_topk", "stream_channels", "ring_rows")
_KEYS = ("schema_version", "kind", "peer", "config", "data", "mailbox")
_MAX = {"num_ranks": 1 << 10, "max_tokens": 1 << 24, "hidden": 1 << 20, "num_topk": 1 << 10, "stream_channels": 1 << 10,
        "ring_rows": 1 << 20}
_MIN = {"stream_channels": 0, "ring_rows": 0}  # 0: a slot layout


def _fail(peer: str, msg: str):
    raise MetadataError(f"ep rank info from peer={peer!r}: {msg}")


def _closed(obj: Any, keys: tuple[str, ...], path: str, peer: str) -> dict:
    if type(obj) is not dict:
        _fail(peer, f"{path} has type {type(obj).__name__}; expected object")
    if set(obj) != set(keys):
        _fail(peer, f"{path} keys {sorted(obj)}; expected exactly {sorted(keys)}")
    return obj


def validate_rank_header(obj: Any, keys: tuple[str, ...], kind: str, config_keys: tuple[str, ...], peer: str) -> dict:
    """Check the parts every ep rank payload shares (exactly ``keys``, version, ``kind``, an ep
    ``peer`` and a ``config`` of exactly ``config_keys``); returns its peer info."""
    _closed(obj, keys, "payload", peer)
    if obj["schema_version"] not in schema.SUPPORTED_SCHEMA_VERSIONS or type(obj["schema_version"]) is not int:
        _fail(peer, f"schema_version={obj['schema_version']!r} is not supported")
    if obj["kind"] != kind:
        _fail(peer, f"kind={obj['kind']!r}; expected {kind!r}")
    info = schema.validate_peer_info(obj["peer"], peer)
    if info["role"] != "ep":
        _fail(peer, f"peer.role={info['role']!r}; expected 'ep'")
    _closed(obj["config"], config_keys, "config", peer)
    return info


def validate_ep_rank(obj: Any, peer: str) -> dict:
    """Check a parsed ``ep_rank`` payload; returns it unchanged. Raises ``MetadataError``."""
    info = validate_rank_header(obj, _KEYS, KIND, CONFIG_KEYS, peer)
    config = obj["config"]
    for key in CONFIG_KEYS:
        value = config[key]
        low = _MIN.get(key, 1)
        if type(value) is not int or not low <= value <= _MAX[key]:
            _fail(peer, f"config.{key}={value!r}; expected an int in [{low}, {_MAX[key]}]")
    if config["num_ranks"] != info["world_size"]:
        _fail(peer, f"config.num_ranks={config['num_ranks']} differs from peer.world_size={info['world_size']}")
    schema.validate_region(obj["data"], peer, "data")
    mailbox = schema.validate_region(obj["mailbox"], peer, "mailbox")
    if mailbox["kind"] != "shm":
        _fail(peer, f"mailbox.kind={mailbox['kind']!r}; expected 'shm'")
    return obj


def check_config(mine: dict, theirs: dict, peer: str) -> None:
    """Raise ``ConfigError`` naming the first field where a peer's config differs from this rank's."""
    for key in CONFIG_KEYS:
        if mine[key] != theirs[key]:
            raise ConfigError(f"ep: peer={peer!r} has {key}={theirs[key]}, this rank {key}={mine[key]}; "
                              "every rank of a group must build its Buffer with the same sizes")


# a payload is under 2 KB: peer info, config and two region descriptors
schema.register_kind(KIND, validate_ep_rank, max_bytes=64 << 10)
