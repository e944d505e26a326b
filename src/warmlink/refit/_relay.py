"""Fan-out: a receiver that holds a version serves it to the other replicas of its engine.

# Note [Fan-out]
N engine replicas take every version. Pulled from the trainer, that is N times the model through
its links; instead a replica that holds a version serves it, and the trainer sends each byte about
once whatever N is. ``Relay`` (one per receiver with ``FanOut``) owns the protocol; who pulls from
whom is Note [Fan-out tree] in ``refit._members``. Three decisions:

* **A relay serves the bytes it pulled, in place.** Replicas of one layout build the same plan,
  hence the same receive region (``ReceiveBuffers``: every tensor and every staged pull's scratch
  at the same offset). A relay serves that region as its pull left it, before and apart from
  translate and install, which with ``install="copy"`` write only memory outside it, or receive
  elements that a staged pull's unstage fills and every replica fills again from its own scratch
  (Note [Install modes] in ``refit._install``). The replica copies the same byte ranges to the same
  offsets (``refit._chunks``), then checks, translates and installs exactly as if they had come
  from the publishers: no second plan, no memory beyond one receiver's, no copy on the relay.
* **The publishers pin the version.** Every replica counts itself in at the publishers as any
  receiver does (Note [Version protocol], Note [Version board]) and pulls the version it entered,
  from a relay or from the publishers. While one replica is inside version v no publisher can
  publish v + 1, so no relay can take a newer version into what it serves: relays need no reader
  counts of their own, and the check every replica makes at the publishers after its pull (Note
  [Version header]) covers bytes that came through relays too, which were read from the
  publishers while v stood. What a replica learns from a relay is only which chunks it may copy.
* **Chunks, pipelined and checked like a seqlock.** A relay's header (``refit._relay_header``, in
  its own transfer memory: incarnation, epoch, version and the label of the publishers'
  generations and manifests, plan signature, served region, chunks held) says how many chunks of
  the version it holds. Before its region takes other bytes (its next pull, other buffers, close)
  a relay writes a new epoch with 0 chunks, or ``closed``; it raises the count after each chunk
  landed (and, for a chunk from its own relay, was checked). A replica reads the header, copies
  the chunks it shows, reads it again, and counts them as its own only if the incarnation,
  epoch, label and region are the same: no byte of them changed while it copied. So no replica
  serves a chunk it does not hold, and every replica's chunks are the version it entered, whoever
  it copied them from; a relay's ``held`` state says its publishers' check passed too.

Failures. A relay that dies (its process lock is free, or the link reports it lost) or closes is
routed around: the replica keeps the chunks it holds and pulls the rest from the relay's own
source, up to the publishers, which still hold the version it is counted in at. One that shows
no progress for ``FanOut.stall_s`` (not yet refitting, stalled, failed) is routed around for
that cycle. A relay whose plan signature or chunking differs is refused (``LayoutError``,
``ConfigError``) before any byte moves. A replica installs only once every chunk arrived and the
publishers' check passed; a failure on the way raises (PeerLostError, TransferTimeout) and
installs nothing, so every replica holds a whole version, old or new.

Counting: a replica pulls from the publishers only what no relay gave it, so a group takes each
byte of a version from the publishers once (``CycleReport.pulled_from`` names where each
replica's bytes came from). Warm path: mappings of the relay a replica pulls from, its prepared
chunk batches and header read are kept across cycles; the driver thread is made at the first.
"""

from __future__ import annotations

import collections
import logging
import queue
import secrets
import threading
import time

from warmlink._backoff import poll
from warmlink.errors import ConfigError, LayoutError, MetadataError, PeerLostError, TransferError, TransferTimeout
from warmlink.pool import liveness
from warmlink.refit import _members
from warmlink.refit._relay_header import (CLOSED, EMPTY, FAILED, FILLING, HELD, RELAY_HEADER_NBYTES, RelayHeader, RelayWords,
                                          digest16)
from warmlink.refit._relay_header import parse as parse_words
from warmlink.rendezvous import schema
from warmlink.transport.base import Copy, PeerRef, local_identity

__all__ = ["Relay", "FanTransfer"]

log = logging.getLogger("warmlink.refit")

PUBLISHERS = "publishers"
WINDOW = 2  # chunk copies in flight from one member: one lands while the next moves


class _RouteAround(Exception):
    """The member being pulled from cannot give more now: try the next source. ``gone``: it died
    or closed, and is never pulled from again."""

    def __init__(self, why: str, *, gone: bool = False) -> None:
        super().__init__(why)
        self.gone = gone


class _Job:
    """One cycle's fill of the served region: what it fills, and how far it got."""

    __slots__ = ("bufs", "chunks", "batches", "version", "label", "deadline", "timeout_s", "cancelled", "finished", "error",
                 "held", "pulled_from", "num_copies")

    def __init__(self, bufs, chunks, batches, version: int, label: bytes, timeout_s: float) -> None:
        self.bufs, self.chunks, self.batches = bufs, chunks, batches
        self.version, self.label = version, label
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.cancelled = False
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.held = 0  # chunks this fill holds, from whichever source: 0 .. held-1
        self.pulled_from: dict[str, int] = {}
        self.num_copies = 0

    def left(self) -> float:
        """Seconds left. Raises TransferTimeout past the deadline, TransferError once cancelled."""
        if self.cancelled:
            raise TransferError("Receiver.refit: fan-out pull cancelled (the cycle ended)")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"Receiver.refit: fan-out pull of version {self.version} not done within "
                                  f"{self.timeout_s:.3f} s; pulled {self.pulled_from}")
        return left

    def count(self, source: str, nbytes: int, num_copies: int) -> None:
        self.pulled_from[source] = self.pulled_from.get(source, 0) + nbytes
        self.num_copies += num_copies


class FanTransfer:
    """A fan-out pull in flight: ``wait`` and ``done`` as a link's ``Transfer``; what it moved, from whom."""

    __slots__ = ("_relay", "_job")

    def __init__(self, relay: "Relay", job: _Job) -> None:
        self._relay, self._job = relay, job

    def done(self) -> bool:
        return self._job.finished.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every chunk is held. Raises what the pull raised (PeerLostError,
        TransferTimeout, LayoutError, ...); TransferTimeout after ``timeout_s`` (the job's own
        deadline usually ends it first, naming what it waited for)."""
        job = self._job
        limit = (timeout_s if timeout_s is not None else job.timeout_s) + 1.0
        if not job.finished.wait(limit):
            self._relay.cancel(job)
            raise TransferTimeout(f"Receiver.refit: fan-out pull of version {job.version} not done within {limit:.3f} s")
        if job.error is not None:
            raise job.error

    @property
    def pulled_from(self) -> dict[str, int]:
        return dict(self._job.pulled_from)

    @property
    def num_copies(self) -> int:
        return self._job.num_copies


class _Upstream:
    """A member this relay pulls from, opened: its record, header and region, prepared reads."""

    __slots__ = ("member", "record", "peer", "header", "region", "region_digest", "header_batch", "batches")

    def __init__(self, member: int, record: dict, peer: PeerRef) -> None:
        self.member, self.record, self.peer = member, record, peer
        self.header = self.region = self.header_batch = None
        self.region_digest = digest16(record["region"])
        self.batches: tuple | None = None  # (my region, chunking, prepared batch per chunk)

    @property
    def name(self) -> str:
        return f"replica {self.member}"


class Relay:
    """One receiver's part in fan-out (Note [Fan-out]): it joins its group, fills its receive region
    from the replica before it or from the publishers, and serves it to the replicas after it.

    The receiver calls, per cycle: ``pull`` (returns the transfer), then ``verified`` once the
    publishers' check passed and ``keep`` once installed, or ``failed``; ``close`` at its end.
    """

    def __init__(self, config, store, timeout_s: float) -> None:
        self.config = config
        self.store = store
        self.timeout_s = timeout_s
        self.member = 0  # this receiver's number in its group, from its first cycle
        self.incarnation = secrets.randbits(63)
        self._link = None
        self._header: RelayHeader | None = None
        self._words: RelayWords | None = None  # what the header says now
        self._lock = threading.Lock()  # header writes: the driver's progress against a cycle's end
        self._served = None  # (state, token) of the buffers served between cycles
        self._announced: dict | None = None  # the region descriptor the record names
        self._upstreams: dict[int, _Upstream] = {}
        self._gone: set[int] = set()  # members that died or closed: never pulled from again
        self._absent_since: dict[int, float] = {}
        self._read_into = None  # where upstream headers are read into
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None

    # -- the receiver's calls ----------------------------------------------------------------
    def pull(self, state, plan, bufs, version: int, timeout_s: float) -> FanTransfer:
        """Start filling ``bufs`` (the cycle's receive buffers of ``plan``) with ``version``, which
        the cycle entered at the publishers of ``state.sources``; returns once the fill is queued."""
        sources = state.sources
        if self.member == 0:
            self._join(state.link, plan, bufs)
        chunks, batches = bufs.chunked(plan, sources, self.config.chunk_bytes_for(plan.link_nbytes))
        label = digest16([sources.generations(), list(sources.digests())])
        job = _Job(bufs, chunks, batches, version, label, timeout_s)
        with self._lock:  # a new epoch before the region takes a byte of it: Note [Fan-out]
            old = self._words
            self._write(RelayWords(self.incarnation, old.epoch + 1, version, FILLING, 0, chunks.num_chunks, chunks.chunk_bytes,
                                   chunks.nbytes, label, digest16(plan.signature), digest16(bufs.region.desc)))
            self._job = job
        if bufs.region.desc != self._announced:  # other buffers (a new plan, or pooling off): tell the store
            self._announce(bufs.region.desc)
        if self._thread is None:
            self._thread = threading.Thread(target=self._drive, name="warmlink-fanout", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return FanTransfer(self, job)

    def verified(self) -> None:
        """The cycle's bytes passed the publishers' check: the header says ``held``."""
        with self._lock:
            self._write(self._words._replace(state=HELD))

    def keep(self, state, token) -> None:
        """The cycle installed: hold its buffers (``token``), which are served until the next
        cycle's header moves on, and let the previous cycle's go."""
        old, self._served = self._served, (state, token)
        if old is not None:
            old[0].release_buffers(old[1])

    def failed(self) -> None:
        """The cycle failed: its fill stops and the header says ``failed`` (its region holds what
        it may). Safe to call when nothing was pulled."""
        with self._lock:
            if self._job is not None:
                self._job.cancelled = True
            if self._words is not None and self._words.state != CLOSED:
                self._write(self._words._replace(state=FAILED))

    def cancel(self, job: _Job) -> None:
        with self._lock:
            job.cancelled = True

    def close(self) -> None:
        """Say ``closed``, stop the driver, close upstream mappings and give back the header and
        the served buffers. Idempotent."""
        with self._lock:
            if self._job is not None:
                self._job.cancelled = True
            if self._words is not None and self._words.state != CLOSED:
                self._write(self._words._replace(state=CLOSED))
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=self.timeout_s)
        for up in list(self._upstreams.values()):
            self._close_upstream(up)
        link, self._link = self._link, None
        if link is not None:
            for region in (self._read_into, self._header.region):
                if region is not None:
                    link.release(region)
        self._read_into = self._header = None
        served, self._served = self._served, None
        if served is not None:
            served[0].release_buffers(served[1])

    # -- joining -----------------------------------------------------------------------------
    def _join(self, link, plan, bufs) -> None:
        """Take a member number and write this relay's record (Note [Fan-out tree]); a join that
        failed (the store) is tried again by the next cycle."""
        import torch

        if self._link is None:  # the header and the place headers are read into: once, given back by close
            self._link = link
            self._header = RelayHeader(link.allocate(RELAY_HEADER_NBYTES))
            device = "cpu" if link.device < 0 else torch.device("cuda", link.device)
            try:
                self._read_into = link.local_region(torch.empty(RELAY_HEADER_NBYTES, dtype=torch.uint8, device=device))
            except LayoutError:
                self._read_into = link.allocate(RELAY_HEADER_NBYTES)
        self._write(RelayWords(self.incarnation, 0, 0, EMPTY, 0, 0, 0, 0, b"", digest16(plan.signature), digest16(bufs.region.desc)))
        c = self.config
        member = self.store.add(_members.members_key(c.group, c.rank), 1, checked=False)
        if not 1 <= member < 1 << 40:
            raise MetadataError(f"Receiver.refit: store key {_members.members_key(c.group, c.rank)!r} gave member number "
                                f"{member}; expected 1 to 2**40 (a forged counter?)")
        self.member = member
        self._announce(bufs.region.desc)
        log.info("fan-out member joined", extra={"group": c.group, "rank": c.rank, "member": self.member,
                                                  "source": _members.parent(self.member, c.degree)})

    def _announce(self, region: dict) -> None:
        c = self.config
        record = _members.make_record(group=c.group, rank=c.rank, member=self.member, incarnation=self.incarnation,
                                      identity=local_identity(), token=liveness.token(), backend=self._link.backend,
                                      header=self._header.region.desc, region=region)
        self.store.set_json(_members.member_key(c.group, c.rank, self.member), record)
        self._announced = region

    def _write(self, words: RelayWords) -> None:
        self._header.write(words)
        self._words = words

    # -- the driver --------------------------------------------------------------------------
    def _drive(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with self._link.device_scope():
                    self._fill(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the cycle, which raises it
                job.error = exc
            finally:
                job.finished.set()

    def _fill(self, job: _Job) -> None:
        for member in _members.ancestors(self.member, self.config.degree):  # the last is 0, the publishers
            if member in self._gone:
                continue
            if member == 0:
                self._from_publishers(job)
                return
            try:
                self._from_member(job, member)
                return
            except _RouteAround as why:  # the chunks held so far stay: the next source gives the rest
                log.info("fan-out routes around a replica", extra={"member": self.member, "source": member, "why": str(why),
                                                                   "held": job.held})

    def _progress(self, job: _Job, held: int) -> None:
        job.held = held
        with self._lock:
            if not job.cancelled:
                self._write(self._words._replace(held=held))

    def _from_publishers(self, job: _Job) -> None:
        issued = []
        try:
            for k in range(job.held, job.chunks.num_chunks):
                batch = job.batches[k]
                issued.append((k, batch, self._link.read(batch) if batch is not None else None))
            for k, batch, transfer in issued:
                if transfer is not None:
                    transfer.wait(job.left())
                    job.count(PUBLISHERS, batch.nbytes, batch.num_copies)
                self._progress(job, k + 1)
        finally:
            _settle([t for _, _, t in issued], job.timeout_s)

    def _from_member(self, job: _Job, member: int) -> None:
        """Copy chunks from ``member`` as it shows them held, from ``job.held`` until every chunk
        is held. Raises _RouteAround when it gives no more.

        At most ``WINDOW`` chunk copies are in flight; each header read verifies the copies that had
        landed before it was issued (Note [Fan-out]) and says what the member holds now, while the
        next copy keeps the link busy. A mapping closes only once no copy reads it."""
        up = self._upstream(job, member)
        held = job.held
        last_move, sleep_s = time.monotonic(), 50e-6
        inflight: collections.deque = collections.deque()  # (chunk, transfer), in chunk order from ``held``
        try:
            up, words = self._current(job, up)
            while True:
                job.left()
                if inflight or self._serves(job, words, held):
                    batches = self._batches(job, up)
                    k = held + len(inflight)
                    while len(inflight) < WINDOW and self._serves(job, words, k):
                        inflight.append((k, self._link.read(batches[k])))
                        k += 1
                    self._land(job, up, inflight[0][1])
                    landed = 0
                    while landed < len(inflight) and inflight[landed][1].done():
                        landed += 1
                    after = self._read(job, up)
                    for _ in range(landed):
                        chunk, _t = inflight.popleft()
                        job.count(up.name, batches[chunk].nbytes, batches[chunk].num_copies)
                    if words.same_fill(after):  # Note [Fan-out]: nothing of those chunks changed while they were copied
                        held += landed
                        self._progress(job, held)
                        last_move, sleep_s = time.monotonic(), 50e-6
                        if held == job.chunks.num_chunks:
                            return
                        words = after
                        continue
                    _settle([t for _, t in inflight], job.timeout_s)  # its region took other bytes: in flight is void
                    inflight.clear()
                    up, words = self._current(job, up, after)
                    continue
                if words is not None and words.state == FAILED and words.label == job.label:
                    raise _RouteAround(f"{up.name} failed its pull of this version")
                if time.monotonic() - last_move > self.config.stall_s:
                    raise _RouteAround(f"{up.name} showed no progress for {self.config.stall_s:.3g} s "
                                       f"({words.describe() if words is not None else 'no header'})")
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, 5e-3)
                up, words = self._current(job, up)
        except _RouteAround as exc:
            _settle([t for _, t in inflight], job.timeout_s)
            inflight.clear()
            if exc.gone:
                self._lost(up)
            raise
        finally:
            _settle([t for _, t in inflight], job.timeout_s)

    @staticmethod
    def _serves(job: _Job, words: RelayWords | None, chunk: int) -> bool:
        """Whether ``words`` show ``chunk`` of this job's version held."""
        return (words is not None and words.state in (FILLING, HELD) and words.version == job.version
                and words.label == job.label and words.held > chunk)

    @staticmethod
    def _land(job: _Job, up: _Upstream, transfer) -> None:
        """Wait for one read from ``up`` (a chunk or its header); its failures route around it."""
        try:
            transfer.wait(job.left())
        except PeerLostError as exc:
            raise _RouteAround(str(exc), gone=True) from None
        except (TransferError, TransferTimeout) as exc:
            job.left()  # the cycle's own end is not the member's fault
            raise _RouteAround(str(exc)) from None

    def _current(self, job: _Job, up: _Upstream, words: RelayWords | None = None) -> tuple[_Upstream, RelayWords | None]:
        """``up`` and its header (``words`` if just read, else read now; None: nothing to serve
        yet), with nothing of ``up``'s in flight. A header naming another region than the one
        opened means ``up`` moved to other buffers: it is opened again from its record."""
        if words is None:
            words = self._read(job, up)
        if words is not None and words.region != up.region_digest:
            self._close_upstream(up)
            up = self._upstream(job, up.member)
            words = self._read(job, up)
            if words is not None and words.region != up.region_digest:
                return up, None  # its record has not caught up with its header yet
        return up, words

    # -- members pulled from -----------------------------------------------------------------
    def _upstream(self, job: _Job, member: int) -> _Upstream:
        """``member`` opened (cached across cycles); waits up to ``stall_s`` for its record."""
        up = self._upstreams.get(member)
        if up is not None:
            return up
        c = self.config
        key = _members.member_key(c.group, c.rank, member)
        peer_name = f"fan-out {c.group}/{c.rank} replica {member}"
        while True:
            try:
                raw = self.store.try_get(key, peer=peer_name, timeout_s=job.left())
                record = schema.decode(raw, _members.KIND, peer_name) if raw is not None else None
            except MetadataError as exc:  # a bad record costs its member this receiver's pulls, not the cycle
                log.warning("fan-out record refused", extra={"source": member, "error": str(exc)})
                raise _RouteAround(str(exc)) from None
            if record is not None and record["region"] is not None:
                break
            first = self._absent_since.setdefault(member, time.monotonic())
            if time.monotonic() - first > c.stall_s:
                raise _RouteAround(f"replica {member} has announced no region for {c.stall_s:.3g} s")
            time.sleep(0.01)
        self._absent_since.pop(member, None)
        if (record["member"], record["group"], record["rank"]) != (member, c.group, c.rank):
            raise _RouteAround(f"record under {key!r} names member {record['member']} of {record['group']}/{record['rank']}")
        if record["backend"] != self._link.backend:
            raise ConfigError(f"Receiver.refit: {peer_name} uses backend={record['backend']!r}, this receiver "
                              f"{self._link.backend!r}; every replica of a fan-out group must use the same backend")
        token = record["token"] or None
        peer = PeerRef(f"{getattr(self.store, 'prefix', '')}:fanout/{c.group}/{c.rank}/{member}", member, record["host"],
                       record["pid"], record["start_time"], token)
        up = _Upstream(member, record, peer)
        try:
            up.header = self._link.open(peer, record["header"])
            up.region = self._link.open(peer, record["region"])
        except (PeerLostError, MetadataError, LayoutError) as exc:
            self._close_upstream(up)
            if not peer.alive():
                self._gone.add(member)
            raise _RouteAround(f"{up.name}: {exc}") from None
        up.header_batch = self._link.prepare([Copy(self._read_into, 0, up.header, 0, RELAY_HEADER_NBYTES)])
        self._upstreams[member] = up
        return up

    def _read(self, job: _Job, up: _Upstream) -> RelayWords | None:
        """``up``'s header now, checked against its record and this relay's layout: None while it
        holds nothing to serve. Raises _RouteAround for a member gone, typed errors for one that
        cannot serve this receiver at all."""
        self._land(job, up, self._link.read(up.header_batch))
        words = parse_words(self._read_into.tensor[:RELAY_HEADER_NBYTES].cpu().numpy().tobytes())
        if words is None or words.incarnation != up.record["incarnation"] or words.state == CLOSED:
            # its header memory went back, or holds another relay's words: it closed
            raise _RouteAround(f"{up.name} closed", gone=True)
        mine = self._words
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

    def _batches(self, job: _Job, up: _Upstream) -> list:
        """The prepared copy of each chunk from ``up``'s region into this cycle's (kept per upstream)."""
        region, chunks = job.bufs.region, job.chunks
        cached = up.batches
        if cached is None or cached[0] is not region or cached[1] != chunks:
            if up.region.nbytes < region.nbytes:
                raise LayoutError(f"Receiver.refit: fan-out {up.name} serves {up.region.nbytes} bytes, this receiver's "
                                  f"region holds {region.nbytes}; expected the same receive region")
            batches = [self._link.prepare([Copy(region, o, up.region, o, n) for o, n in piece]) for piece in chunks.pieces]
            cached = up.batches = (region, chunks, batches)
        return cached[2]

    def _lost(self, up: _Upstream) -> None:
        """``up`` died or closed: never pulled from again; its mappings close."""
        self._gone.add(up.member)
        self._close_upstream(up)
        self._link.forget_peer(up.peer.key)

    def _close_upstream(self, up: _Upstream) -> None:
        if self._upstreams.get(up.member) is up:
            del self._upstreams[up.member]
        up.batches = up.header_batch = None
        for region in (up.header, up.region):
            if region is not None:
                self._link.close_region(region)
        up.header = up.region = None

    def __repr__(self) -> str:
        words = self._words
        return (f"Relay({self.config.group}/{self.config.rank} member {self.member}, "
                f"{words.describe() if words is not None else 'not joined'})")


def _settle(transfers, timeout_s: float) -> None:
    """Wait (bounded) until no copy of ``transfers`` still runs: a fill ends only when nothing it
    issued can land later, in a region whose header has moved on."""
    pending = [t for t in transfers if t is not None and not t.done()]
    for t in pending:
        t.cancel()
    if pending and not poll(lambda: all(t.done() for t in pending), timeout_s):
        log.warning("fan-out copies still running after the fill ended", extra={"num_pending": len(pending)})
