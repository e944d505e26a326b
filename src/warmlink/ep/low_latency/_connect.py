"""The ``ep_ll_rank`` payload and the rendezvous of a low-latency region: each rank publishes its
region and mailbox once, maps every peer's, and checks that every rank was built with the same sizes.

::

    {"schema_version": 1, "kind": "ep_ll_rank", "peer": <peer_info payload, role "ep">,
     "config": {"num_ranks": R, "max_tokens": T, "hidden": H, "num_experts": E, "num_topk": K},
     "data": <region: the rank's low-latency region>, "mailbox": <region: its shm mailbox>}
"""

from __future__ import annotations

from typing import Any

from warmlink.ep.low_latency._layout import LowLatencyLayout
from warmlink.ep.wire import mailbox as mb
from warmlink.ep.wire.info import validate_rank_header
from warmlink.errors import ConfigError, MetadataError
from warmlink.rendezvous import schema

__all__ = ["KIND", "Peers", "connect"]

KIND = "ep_ll_rank"
_CONFIG_KEYS = ("num_ranks", "max_tokens", "hidden", "num_experts", "num_topk")
_KEYS = ("schema_version", "kind", "peer", "config", "data", "mailbox")
_MAX = 1 << 24


def _fail(peer: str, msg: str):
    raise MetadataError(f"ep low-latency rank info from peer={peer!r}: {msg}")


def validate(obj: Any, peer: str) -> dict:
    """Check a parsed ``ep_ll_rank`` payload; returns it unchanged. Raises ``MetadataError``."""
    info = validate_rank_header(obj, _KEYS, KIND, _CONFIG_KEYS, peer)
    config = obj["config"]
    for key in _CONFIG_KEYS:
        if type(config[key]) is not int or not 1 <= config[key] <= _MAX:
            _fail(peer, f"config.{key}={config[key]!r}; expected an int in [1, {_MAX}]")
    if config["num_ranks"] != info["world_size"]:
        _fail(peer, f"config.num_ranks={config['num_ranks']} differs from peer.world_size={info['world_size']}")
    schema.validate_region(obj["data"], peer, "data")
    if schema.validate_region(obj["mailbox"], peer, "mailbox")["kind"] != "shm":
        _fail(peer, f"mailbox.kind={obj['mailbox']['kind']!r}; expected 'shm'")
    return obj


schema.register_kind(KIND, validate, max_bytes=64 << 10)


class Peers:
    """What the rendezvous opened: ``regions[r]`` (each peer's region, mapped here), ``refs[r]``
    (``PeerRef``, for liveness) and the ``(link, region)`` pairs to close."""

    def __init__(self) -> None:
        self.regions: dict[int, object] = {}
        self.refs: dict[int, object] = {}
        self.opened: list[tuple] = []


def connect(store, rank: int, layout: LowLatencyLayout, device: int, backend: str, link, region, mail_link,
            mail_region, mailbox: mb.Mailbox, timeout_s: float, peers: Peers) -> None:
    """Publish this rank's region and mailbox, open every peer's into ``peers`` and attach their
    mailboxes. Collective: the n-th low-latency Buffer of every rank forms group n.

    Raises:
        ConfigError: a peer built with other sizes. MetadataError: a malformed payload.
        TransferTimeout: a peer never published.
    """
    from warmlink.transport.base import PeerRef, local_identity

    num_ranks = layout.num_ranks
    generation = store.next_generation(f"ep-ll/{rank}", timeout_s=timeout_s)
    mailbox.set_generation(generation)
    epoch = (store.add("ep-ll/joins", 1, checked=False, timeout_s=timeout_s) - 1) // num_ranks + 1
    host, pid, start = local_identity()
    info = {"schema_version": 1, "kind": KIND,
            "peer": {"schema_version": 1, "kind": "peer_info", "role": "ep", "rank": rank, "world_size": num_ranks,
                     "generation": generation, "host": host, "pid": pid, "start_time": start, "device": device,
                     "backend": backend},
            "config": layout.config(), "data": region.desc, "mailbox": mail_region.desc}
    store.set(f"ep-ll/{epoch}/{rank}", schema.encode(info), timeout_s=timeout_s)
    for r in range(num_ranks):
        if r == rank:
            continue
        name = f"ep-ll/{r}"
        theirs = schema.decode(store.get(f"ep-ll/{epoch}/{r}", timeout_s=timeout_s), KIND, name)
        for key in _CONFIG_KEYS:
            if theirs["config"][key] != layout.config()[key]:
                raise ConfigError(f"ep low-latency: peer={name!r} has {key}={theirs['config'][key]}, this rank "
                                  f"{key}={layout.config()[key]}; every rank must build its Buffer with the same sizes")
        p = theirs["peer"]
        if p["rank"] != r:
            _fail(name, f"peer.rank={p['rank']}; expected {r}")
        ref = PeerRef(f"{store.prefix}:{name}", p["generation"], p["host"], p["pid"], p["start_time"])
        link.forget_peer(ref.key, keep_process=ref.process_id)  # a replaced process's mappings
        data = link.open(ref, theirs["data"])
        peers.opened.append((link, data))
        mail = mail_link.open(ref, theirs["mailbox"])
        peers.opened.append((mail_link, mail))
        if data.nbytes < layout.region_nbytes:
            _fail(name, f"data.nbytes={data.nbytes}; expected >= {layout.region_nbytes}")
        peers.regions[r], peers.refs[r] = data, ref
        mailbox.attach(r, mail.tensor, ref)
