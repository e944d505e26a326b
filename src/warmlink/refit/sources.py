"""What a receiver knows about the publishers: states, manifests and opened regions.

Manifests are read once per publisher generation. When a publisher restarts (new generation), its
old mappings are closed and its new manifest read; the other publishers' mappings stay open.
"""

from __future__ import annotations

import logging

from warmlink.errors import ConfigError, LayoutError, MetadataError
from warmlink.refit import protocol
from warmlink.refit.manifest import TensorLayout
from warmlink.transport.base import PeerRef, RemoteRegion

__all__ = ["SourceSet"]

log = logging.getLogger("warmlink.refit")


class _Source:
    __slots__ = ("peer", "layouts", "where", "regions", "opened")

    def __init__(self, peer: PeerRef, layouts: list[TensorLayout], where: dict[str, tuple[int, int]], regions: list[dict]) -> None:
        self.peer = peer
        self.layouts = layouts
        self.where = where  # tensor name -> (region index, offset in bytes)
        self.regions = regions
        self.opened: dict[int, RemoteRegion] = {}


class SourceSet:
    """The publishers one receiver pulls from."""

    def __init__(self, store, link, num_publishers: int) -> None:
        self.store = store
        self.link = link
        self.num_publishers = num_publishers
        self._sources: list[_Source | None] = [None] * num_publishers

    def states(self, timeout_s: float) -> list[protocol.VersionState]:
        return [protocol.read_state(self.store, rank, timeout_s=timeout_s) for rank in range(self.num_publishers)]

    def refresh(self, states: list[protocol.VersionState]) -> None:
        """Read the manifest of every rank whose generation changed."""
        for rank, state in enumerate(states):
            src = self._sources[rank]
            if src is not None and src.peer.generation == state.generation:
                continue
            new = self._load(rank, state.generation)
            if src is not None:
                self._close(src)
                log.info("publisher re-created", extra={"rank": rank, "generation": state.generation})
            # Mappings follow the process: a publisher re-created in the same process keeps those
            # of regions it still exports; another process's (one that left while no receiver of
            # this process watched, too) are closed.
            keep = {self.link.region_id(d) for d in new.regions}
            self.link.forget_peer(new.peer.key, keep_process=new.peer.process_id, keep_regions=keep)
            self._sources[rank] = new

    def _load(self, rank: int, generation: int) -> _Source:
        peer_name = f"publisher/{rank}"
        m = self.store.get_json(protocol.manifest_key(rank, generation), "publisher_manifest", peer_name)
        info = m["peer"]
        if info["rank"] != rank or info["generation"] != generation:
            raise MetadataError(
                f"publisher manifest from peer={peer_name!r}: peer.rank={info['rank']}, peer.generation={info['generation']}; "
                f"expected rank={rank}, generation={generation}"
            )
        if info["world_size"] != self.num_publishers:
            raise LayoutError(
                f"Receiver: publisher/{rank} reports world_size={info['world_size']}; this receiver expects "
                f"num_publishers={self.num_publishers}"
            )
        if info["backend"] != self.link.backend:
            raise ConfigError(
                f"Receiver: publisher/{rank} uses backend={info['backend']!r}, this receiver {self.link.backend!r}; "
                "both sides must use the same backend"
            )
        for i, region in enumerate(m["regions"]):
            if region["kind"] != self.link.backend:
                raise MetadataError(
                    f"publisher manifest from peer={peer_name!r}: regions[{i}].kind={region['kind']!r}; "
                    f"expected {self.link.backend!r} (this receiver's backend)"
                )
        layouts, where = [], {}
        for t in m["tensors"]:
            layouts.append(TensorLayout.from_json(t))
            where[t["name"]] = (t["region"], t["offset"])
        # The slot key carries the job's store prefix: two jobs in one process never share or evict
        # each other's mappings.
        key = f"{getattr(self.store, 'prefix', '')}:{peer_name}"
        peer = PeerRef(key, generation, info["host"], info["pid"], info["start_time"])
        return _Source(peer, layouts, where, m["regions"])

    def layouts(self) -> dict[int, list[TensorLayout]]:
        return {rank: src.layouts for rank, src in enumerate(self._sources)}

    def generations(self) -> tuple[int, ...]:
        return tuple(src.peer.generation for src in self._sources)

    def region_of(self, rank: int, tensor: str) -> tuple[RemoteRegion, int]:
        """The opened region holding ``tensor`` of ``rank`` and the tensor's offset in it (bytes)."""
        src = self._sources[rank]
        region_idx, offset = src.where[tensor]
        region = src.opened.get(region_idx)
        if region is None:
            region = src.opened[region_idx] = self.link.open(src.peer, src.regions[region_idx])
        return region, offset

    def _close(self, src: _Source) -> None:
        for region in src.opened.values():
            self.link.close_region(region)
        src.opened.clear()

    def close_regions(self) -> None:
        for src in self._sources:
            if src is not None:
                self._close(src)
