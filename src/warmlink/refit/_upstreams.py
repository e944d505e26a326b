"""The members one fan-out relay pulls from: opened from their records, their headers read and
checked, their chunks' copies prepared; kept across cycles (Note [Fan-out] in ``refit._relay``,
Note [Fan-out tree] in ``refit._members``).

What a record says is only where to look: a member's header, read through the link (or, for a
member on this host, from its copy in shared memory: Note [Relay header in host memory] in
``refit._relay_header``), says which of the regions its record names it serves (their digests),
whether the header is this member's (its incarnation) and whether it can serve this receiver at
all (plan signature, chunking).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from warmlink.errors import (ConfigError, LayoutError, MetadataError, PeerLostError, TransferError, TransferTimeout,
                             WarmlinkError)
from warmlink.refit import _members
from warmlink.refit._relay_header import CLOSED, EMPTY, RELAY_HEADER_NBYTES, RelayWords, digest16
from warmlink.refit._relay_header import parse as parse_words
from warmlink.rendezvous import schema
from warmlink.transport.base import Copy, PeerRef

__all__ = ["RouteAround", "Upstream", "Upstreams", "land"]

log = logging.getLogger("warmlink.refit")
# reads of a header before its words count as unreadable this time: a read may meet a write half
# done, and the writer may be preempted inside it (Note [Relay header in host memory]); rereads
# back off from 50 us, doubling: 11 reads span about 50 ms
_READS = 11
_FIRST_REREAD_S = 50e-6


def _reread(read_once: Callable[[], bytes]) -> RelayWords | None:
    """The words of ``read_once()``, read again while a write is half done (the checksum fails),
    after a pause that doubles from ``_FIRST_REREAD_S``; None when all ``_READS`` reads were torn."""
    pause = _FIRST_REREAD_S
    for _ in range(_READS - 1):
        words = parse_words(read_once())
        if words is not None:
            return words
        time.sleep(pause)
        pause *= 2
    return parse_words(read_once())


class RouteAround(Exception):
    """The member being pulled from cannot give more now: try the next source. ``gone``: it died
    or closed, and is never pulled from again."""

    def __init__(self, why: str, *, gone: bool = False) -> None:
        super().__init__(why)
        self.gone = gone


def land(transfer, left: Callable[[], float]) -> None:
    """Wait for one read from a member (a chunk or its header), ``left()`` seconds at most; its
    failures route around the member (``left`` raises first when the cycle itself ran out)."""
    try:
        transfer.wait(left())
    except PeerLostError as exc:
        raise RouteAround(str(exc), gone=True) from None
    except (TransferError, TransferTimeout) as exc:
        left()  # the cycle's own end is not the member's fault
        raise RouteAround(str(exc)) from None


class Upstream:
    """A member this relay pulls from, opened: its record, header and regions, prepared reads.
    ``region``: the one its header names now (``serving`` picks it)."""

    __slots__ = ("member", "record", "peer", "header", "host_header", "regions", "region", "header_batch", "batches")

    def __init__(self, member: int, record: dict, peer: PeerRef) -> None:
        self.member, self.record, self.peer = member, record, peer
        self.header = self.host_header = self.region = self.header_batch = None
        self.regions: dict = {}  # descriptor digest -> opened region, every one the record names
        # ids of (its region, my region) -> (both, chunking, prepared batch per chunk): swap's two halves each side
        self.batches: dict = {}

    def serving(self, words: RelayWords) -> bool:
        """Point ``region`` at the region ``words`` name; False when the record names no such one."""
        self.region = self.regions.get(words.region)
        return self.region is not None

    @property
    def name(self) -> str:
        return f"replica {self.member}"


class Upstreams:
    """The members one relay pulls from, over ``link`` (the relay's), for receivers of ``config``
    (its ``FanOut``). ``gone``: members that died or closed, never opened again."""

    def __init__(self, config, store, link, timeout_s: float) -> None:
        import torch

        self.config, self.store, self.link, self.timeout_s = config, store, link, timeout_s
        self._host = None  # a shared-memory link lease: members' header copies on this host
        self.gone: set[int] = set()
        self._open: dict[int, Upstream] = {}
        self._absent_since: dict[int, float] = {}
        device = "cpu" if link.device < 0 else torch.device("cuda", link.device)
        try:  # where headers are read into
            self._read_into = link.local_region(torch.empty(RELAY_HEADER_NBYTES, dtype=torch.uint8, device=device))
        except LayoutError:
            self._read_into = link.allocate(RELAY_HEADER_NBYTES)

    def current(self, up: Upstream, left: Callable[[], float], mine: RelayWords,
                words: RelayWords | None = None) -> tuple[Upstream, RelayWords | None]:
        """``up`` and its header (``words`` if just read, else read now; None: nothing to serve
        yet), with nothing of ``up``'s in flight. A header naming a region its record did not
        means ``up`` moved to other buffers: it is opened again from its record."""
        if words is None:
            words = self.read(up, left, mine)
        if words is not None and not up.serving(words):
            self.close(up)
            up = self.get(up.member, left)
            words = self.read(up, left, mine)
            if words is not None and not up.serving(words):
                return up, None  # its record has not caught up with its header yet
        return up, words

    def get(self, member: int, left: Callable[[], float]) -> Upstream:
        """``member`` opened (kept across cycles); waits up to ``stall_s`` for its record."""
        up = self._open.get(member)
        if up is not None:
            return up
        c = self.config
        key = _members.member_key(c.group, c.rank, member)
        peer_name = f"fan-out {c.group}/{c.rank} replica {member}"
        while True:
            try:
                raw = self.store.try_get(key, peer=peer_name, timeout_s=left())
                record = schema.decode(raw, _members.KIND, peer_name) if raw is not None else None
            except MetadataError as exc:  # a bad record costs its member this receiver's pulls, not the cycle
                log.warning("fan-out record refused", extra={"source": member, "error": str(exc)})
                raise RouteAround(str(exc)) from None
            if record is not None and record["regions"]:
                break
            first = self._absent_since.setdefault(member, time.monotonic())
            if time.monotonic() - first > c.stall_s:
                raise RouteAround(f"replica {member} has announced no region for {c.stall_s:.3g} s")
            time.sleep(0.01)
        self._absent_since.pop(member, None)
        if (record["member"], record["group"], record["rank"]) != (member, c.group, c.rank):
            raise RouteAround(f"record under {key!r} names member {record['member']} of {record['group']}/{record['rank']}")
        if record["backend"] != self.link.backend:
            raise ConfigError(f"Receiver.refit: {peer_name} uses backend={record['backend']!r}, this receiver "
                              f"{self.link.backend!r}; every replica of a fan-out group must use the same backend")
        token = record["token"] or None
        peer = PeerRef(f"{getattr(self.store, 'prefix', '')}:fanout/{c.group}/{c.rank}/{member}", member, record["host"],
                       record["pid"], record["start_time"], token)
        up = Upstream(member, record, peer)
        try:
            up.header = self.link.open(peer, record["header"])
            for desc in record["regions"]:
                up.regions[digest16(desc)] = self.link.open(peer, desc)
        except (PeerLostError, MetadataError, LayoutError) as exc:
            self.close(up)
            if not peer.alive():
                self.gone.add(member)
            raise RouteAround(f"{up.name}: {exc}") from None
        up.header_batch = self.link.prepare([Copy(self._read_into, 0, up.header, 0, RELAY_HEADER_NBYTES)])
        up.host_header = self._open_host_header(up)
        self._open[member] = up
        return up

    def _open_host_header(self, up: Upstream):
        """``up``'s header copy in this host's shared memory, opened; None when it has none, or it
        is on another host (another /dev/shm), or it cannot be opened: then its header is read
        through the link."""
        from warmlink.pool import liveness
        from warmlink.transport import lease_link

        desc, key = up.record["host_header"], liveness.local_key()
        if desc is None or key is None or not (up.record["token"] or "").startswith(key + "/"):
            return None
        try:
            if self._host is None:
                self._host = lease_link("shm", -1, self.timeout_s)
            region = self._host.resource.open(up.peer, desc)
        except (WarmlinkError, OSError) as exc:
            log.info("fan-out header read through the link", extra={"source": up.member, "error": str(exc)})
            return None
        if region.nbytes < RELAY_HEADER_NBYTES:
            self._host.resource.close_region(region)
            return None
        return region

    def read(self, up: Upstream, left: Callable[[], float], mine: RelayWords) -> RelayWords | None:
        """``up``'s header now, checked against its record and against ``mine`` (the relay's own
        words): None while it holds nothing to serve. Raises RouteAround for a member gone, typed
        errors for one that cannot serve this receiver at all."""
        words = self._read_host(up) if up.host_header is not None else self._read_link(up, left)
        if words is None:  # torn every time: its writer stalled inside a write, not gone
            raise RouteAround(f"{up.name}'s header stayed torn through {_READS} reads")
        if words.incarnation != up.record["incarnation"] or words.state == CLOSED:
            # its header memory went back, or holds another relay's words: it closed
            raise RouteAround(f"{up.name} closed", gone=True)
        if words.signature != mine.signature:
            raise LayoutError(
                f"Receiver.refit: fan-out group {self.config.group!r} rank {self.config.rank}: {up.name} holds another "
                f"layout (plan signature {words.signature.hex()}, this receiver's {mine.signature.hex()}); every replica of "
                "a group and rank must declare the same tensors in the same layout (FanOut(rank=) is the engine's TP rank)")
        if words.state == EMPTY:
            return None
        if (words.num_chunks, words.chunk_bytes, words.served_nbytes) != (mine.num_chunks, mine.chunk_bytes, mine.served_nbytes):
            raise ConfigError(
                f"Receiver.refit: fan-out group {self.config.group!r} rank {self.config.rank}: {up.name} cuts its region into "
                f"{words.num_chunks} chunks of {words.chunk_bytes} bytes, this receiver into {mine.num_chunks} of "
                f"{mine.chunk_bytes}; expected the same FanOut(chunk_bytes=) on every replica")
        return words

    def _read_link(self, up: Upstream, left: Callable[[], float]) -> RelayWords | None:
        def read_once() -> bytes:
            land(self.link.read(up.header_batch), left)
            return self._read_into.tensor[:RELAY_HEADER_NBYTES].cpu().numpy().tobytes()

        return _reread(read_once)

    def _read_host(self, up: Upstream) -> RelayWords | None:
        """The header copy in shared memory. A read through the link fails on a dead member; this
        one checks it lives."""
        if not up.peer.alive():
            raise RouteAround(f"{up.name} died", gone=True)
        view = up.host_header.tensor[:RELAY_HEADER_NBYTES].numpy()
        return _reread(view.tobytes)

    def batches(self, up: Upstream, region, chunks) -> list:
        """The prepared copy of each of ``chunks`` from ``up``'s region now into ``region`` (the
        cycle's), kept per upstream and pair of regions."""
        key = (id(up.region), id(region))  # the entry holds both, so neither id is reused while it stays
        cached = up.batches.get(key)
        if cached is None or cached[0] is not up.region or cached[1] is not region or cached[2] != chunks:
            if up.region.nbytes < region.nbytes:
                raise LayoutError(f"Receiver.refit: fan-out {up.name} serves {up.region.nbytes} bytes, this receiver's "
                                  f"region holds {region.nbytes}; expected the same receive region")
            if len(up.batches) >= 4:  # two halves each side; more means buffers were replaced
                up.batches.clear()
            batches = [self.link.prepare([Copy(region, o, up.region, o, n) for o, n in piece]) for piece in chunks.pieces]
            cached = up.batches[key] = (up.region, region, chunks, batches)
        return cached[3]

    def lost(self, up: Upstream) -> None:
        """``up`` died or closed: never pulled from again; its mappings close (nothing reads them)."""
        self.gone.add(up.member)
        self.close(up)
        self.link.forget_peer(up.peer.key)

    def close(self, up: Upstream) -> None:
        """Close ``up``'s mappings (nothing of it in flight)."""
        if self._open.get(up.member) is up:
            del self._open[up.member]
        up.batches, up.header_batch = {}, None
        for region in (up.header, *up.regions.values()):
            if region is not None:
                self.link.close_region(region)
        if up.host_header is not None:
            self._host.resource.close_region(up.host_header)
        up.header = up.host_header = up.region = None
        up.regions = {}

    def close_all(self) -> None:
        """Close every member's mappings and give back where headers are read into. Idempotent."""
        for up in list(self._open.values()):
            self.close(up)
        read_into, self._read_into = self._read_into, None
        if read_into is not None:
            self.link.release(read_into)
        host, self._host = self._host, None
        if host is not None:
            host.release()

