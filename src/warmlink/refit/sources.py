"""What a receiver knows about the publishers: states, manifests and opened regions.

Manifests are read once per publisher generation (and once more by a receiver that adopts parked
state). When a publisher restarts (new generation), its old mappings are closed and its new
manifest read; the other publishers' mappings stay open. Manifest bytes already validated in this
process are not validated again (Note [Warm metadata] in ``refit._memo``). Opened regions are a
pool cache: a cycle holds what it opened until ``end_cycle``, after which they stay open for the
next cycle with pooling on and close with pooling off.
"""

from __future__ import annotations

import hashlib
import itertools
import logging

from warmlink.errors import ConfigError, LayoutError, MetadataError
from warmlink.pool.core import SharedCache
from warmlink.refit import protocol
from warmlink.refit._board import ReaderBoard
from warmlink.refit._header import HEADER_NBYTES, Header, digest_prefix
from warmlink.refit._header import parse as parse_header
from warmlink.refit._memo import validated_manifests
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import schema
from warmlink.transport.base import Copy, PeerRef, RemoteRegion

__all__ = ["SourceSet"]

log = logging.getLogger("warmlink.refit")


class _Parsed:
    """A validated manifest, parsed; shared read-only by every receiver of the process."""

    __slots__ = ("info", "regions", "layouts", "where", "digest", "board", "header")

    def __init__(self, digest: str, m: dict) -> None:
        self.info = m["peer"]
        self.board = m["board"]  # where the publisher's version board is (Note [Version board])
        self.header = (m["header"]["region"], m["header"]["offset"])  # Note [Version header] in refit._header
        self.regions = tuple(m["regions"])
        self.layouts = tuple(TensorLayout.from_json(t) for t in m["tensors"])
        self.where = {t["name"]: (t["region"], t["offset"]) for t in m["tensors"]}  # (region index, offset bytes)
        self.digest = digest  # names these exact layouts in plan keys


def _parse(raw: bytes, peer_name: str) -> _Parsed:
    """Decode and validate ``raw``, unless these exact bytes were validated before (pool on:
    Note [Warm metadata] in refit._memo)."""
    digest = hashlib.sha256(raw).hexdigest()
    return validated_manifests.get(digest, lambda _digest: _Parsed(digest, schema.decode(raw, "publisher_manifest", peer_name)))


class _Source:
    __slots__ = ("peer", "layouts", "where", "regions", "digest", "opened", "board", "header", "epoch")
    _made = itertools.count()

    def __init__(self, peer: PeerRef, parsed: _Parsed, board: ReaderBoard | None, link) -> None:
        self.peer = peer
        self.layouts = parsed.layouts
        self.where = parsed.where
        self.regions = parsed.regions
        self.digest = parsed.digest
        # region index -> its mapping; the link's peer mappings are counted already
        self.opened: SharedCache[int, RemoteRegion] = SharedCache("source_region", destroy=link.close_region, counted=False)
        self.board = board  # None: another host's publisher, or no board; its readers count in the store
        self.header = parsed.header
        self.epoch = next(_Source._made)  # names this source's mappings (SourceSet.opened_key)


class SourceSet:
    """The publishers one receiver pulls from."""

    def __init__(self, store, link, num_publishers: int) -> None:
        self.store = store
        self.link = link
        self.num_publishers = num_publishers
        self._sources: list[_Source | None] = [None] * num_publishers
        # This cycle's opened regions by (id of their source, region index), each with its source
        # (kept alive, so the id stays its own) and cache token; released by end_cycle.
        self._held: dict[tuple[int, int], tuple[_Source, RemoteRegion, object]] = {}
        self._verified = True  # False: every manifest is read again once (see unverify)
        self._header_local = None  # where the publishers' version headers are read into
        self._header_batch: tuple | None = None  # (the header regions it reads, the prepared batch)

    def states(self, timeout_s: float) -> list[protocol.VersionState]:
        return [protocol.read_state(self.store, rank, timeout_s=timeout_s) for rank in range(self.num_publishers)]

    def unverify(self) -> None:
        """Read every manifest again at the next ``refresh`` even if its generation is unchanged,
        keeping what the bytes still say: a new owner checks what it adopted (Note [Parked
        receive state] in refit._parked)."""
        self._verified = False

    def refresh(self, states: list[protocol.VersionState]) -> None:
        """Read the manifest of every rank whose generation changed (every rank after ``unverify``)."""
        for rank, state in enumerate(states):
            src = self._sources[rank]
            if src is not None and src.peer.generation == state.generation and self._verified:
                continue
            new = self._load(rank, state.generation)
            if src is not None and src.digest == new.digest:
                if src.board is None:
                    src.board = new.board
                elif new.board is not None:
                    new.board.close()
                continue  # the same bytes: keep the source, its opened regions and its board
            if src is not None:
                self._close(src)
                self._close_board(src)
                log.info("publisher re-created", extra={"rank": rank, "generation": state.generation})
            # Mappings follow the process: a publisher re-created in the same process keeps those
            # of regions it still exports; another process's (one that left while no receiver of
            # this process watched, too) are closed.
            keep = {self.link.region_id(d) for d in new.regions}
            self.link.forget_peer(new.peer.key, keep_process=new.peer.process_id, keep_regions=keep)
            self._sources[rank] = new
        self._verified = True

    def _load(self, rank: int, generation: int) -> _Source:
        peer_name = f"publisher/{rank}"
        try:  # a blob: See Note [Blobs] in rendezvous._blobs
            raw = self.store.get_blob(protocol.manifest_key(rank, generation))
        except MetadataError as e:
            raise MetadataError(f"publisher manifest from peer={peer_name!r}: {e}") from None
        parsed = _parse(raw, peer_name)
        # What the bytes must say for this slot is checked on every load, cached or not.
        info = parsed.info
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
        for i, region in enumerate(parsed.regions):
            if region["kind"] != self.link.backend:
                raise MetadataError(
                    f"publisher manifest from peer={peer_name!r}: regions[{i}].kind={region['kind']!r}; "
                    f"expected {self.link.backend!r} (this receiver's backend)"
                )
        # The slot key carries the job's store prefix: two jobs in one process never share or evict
        # each other's mappings.
        key = f"{getattr(self.store, 'prefix', '')}:{peer_name}"
        # The board's token is the publisher's process lock: it tells whether the publisher lives
        # where its pid cannot (another PID namespace sharing this /dev/shm; Note [Peer identity and generation])
        token = parsed.board["token"] if parsed.board is not None else None
        peer = PeerRef(key, generation, info["host"], info["pid"], info["start_time"], token)
        return _Source(peer, parsed, ReaderBoard.open(parsed.board, info["pid"], peer_name), self.link)

    def place(self) -> tuple[str, str] | None:
        """``(host, GPU UUID)`` where every publisher's regions are, when that is one GPU of one host
        (CUDA IPC regions name their GPU); else None. Fan-out's chain uses it (Note [Fan-out tree])."""
        places = {(src.peer.host, region.get("device_uuid") or "") for src in self._sources if src is not None
                  for region in src.regions}
        if len(places) != 1 or None in self._sources:
            return None
        place = places.pop()
        return place if place[1] else None

    def boards(self) -> tuple[list[ReaderBoard], list[int]] | None:
        """Every publisher's board and the generation planned against, when every one is on this
        host and the manifests read are current (Note [Version board]); else None: the store."""
        if not self._verified:
            return None
        boards, generations = [], []
        for src in self._sources:
            if src is None or src.board is None:
                return None
            boards.append(src.board)
            generations.append(src.peer.generation)
        return boards, generations

    def layouts(self) -> dict[int, tuple[TensorLayout, ...]]:
        return {rank: src.layouts for rank, src in enumerate(self._sources)}

    def digests(self) -> tuple[str, ...]:
        """SHA-256 of each rank's manifest bytes: equal digests, equal source layouts."""
        return tuple(src.digest for src in self._sources)

    def opened_key(self) -> tuple:
        """What a prepared copy batch depends on: the manifests' bytes *and* the source objects
        whose mappings it reads. A source replaced and replaced back (a replayed generation, then
        the present one) has equal digests but its old mappings closed."""
        return tuple((src.digest, src.epoch) for src in self._sources)

    def region_of(self, rank: int, tensor: str) -> tuple[RemoteRegion, int]:
        """The opened region holding ``tensor`` of ``rank`` and the tensor's offset in it (bytes),
        held until ``end_cycle``."""
        src = self._sources[rank]
        region_idx, offset = src.where[tensor]
        return self._opened(src, region_idx), offset

    def _opened(self, src: _Source, region_idx: int) -> RemoteRegion:
        held = self._held.get((id(src), region_idx))
        if held is None:
            region, token = src.opened.acquire(region_idx, lambda i: self.link.open(src.peer, src.regions[i]))
            held = self._held[(id(src), region_idx)] = (src, region, token)
        return held[1]

    def read_headers(self, timeout_s: float) -> list[Header | None]:
        """Every publisher's version header as it is now, read through the link from the regions the
        loaded manifests name (Note [Version header] in refit._header): a ``Header`` per rank, None
        where the region holds none. The regions stay held until ``end_cycle``."""
        n = self.num_publishers
        if self._header_local is None:
            self._header_local = self._header_buffer(HEADER_NBYTES * n)
        copies = [Copy(self._header_local, rank * HEADER_NBYTES, self._opened(src, src.header[0]), src.header[1],
                       HEADER_NBYTES) for rank, src in enumerate(self._sources)]
        remotes = tuple(c.remote for c in copies)
        cached = self._header_batch
        if cached is None or len(cached[0]) != n or any(a is not b for a, b in zip(cached[0], remotes)):
            cached = self._header_batch = (remotes, self.link.prepare(copies))  # kept: the regions' ids stay theirs
        self.link.read(cached[1]).wait(timeout_s)
        raw = self._header_local.tensor[:HEADER_NBYTES * n].cpu().numpy().tobytes()
        return [parse_header(raw[r * HEADER_NBYTES:(r + 1) * HEADER_NBYTES]) for r in range(n)]

    def _header_buffer(self, nbytes: int):
        """Where headers are read into: a small tensor of this process as a local region, or an
        arena where the link copies only into registered memory."""
        import torch

        device = "cpu" if self.link.device < 0 else torch.device("cuda", self.link.device)
        try:
            return self.link.local_region(torch.empty(nbytes, dtype=torch.uint8, device=device))
        except LayoutError:
            return self.link.allocate(nbytes)

    def header_digests(self) -> list[bytes]:
        """Per rank, the digest prefix its header must carry: that of the manifest loaded."""
        return [digest_prefix(src.digest) for src in self._sources]

    def generations(self) -> list[int]:
        """Per rank, the generation of the manifest loaded."""
        return [src.peer.generation for src in self._sources]

    def end_cycle(self) -> None:
        """Let go of the regions this cycle opened or found: kept open for the next cycle with
        pooling on, closed with pooling off (the pool's caches decide)."""
        held, self._held = self._held, {}
        for src, _, token in held.values():
            src.opened.release(token)

    @staticmethod
    def _close(src: _Source) -> None:
        src.opened.clear()  # a region this cycle still holds closes at end_cycle

    @staticmethod
    def _close_board(src: _Source) -> None:
        if src.board is not None:
            src.board.close()
            src.board = None

    def close(self) -> None:
        """Close every opened region and board (the receive state is destroyed)."""
        self.end_cycle()
        self._header_batch = None
        local, self._header_local = self._header_local, None
        if local is not None:
            self.link.release(local)
        for src in self._sources:
            if src is not None:
                self._close(src)
                self._close_board(src)
