"""Fan-out: a receiver that holds a version serves it to the other replicas of its engine.

# Note [Fan-out]
N engine replicas take every version. Pulled from the trainer, that is N times the model through
its links; instead a replica that holds a version serves it, and the trainer sends each byte about
once whatever N is. ``Relay`` (one per receiver with ``FanOut``) owns the protocol, the members it
pulls from are ``refit._upstreams``; who pulls from whom is Note [Fan-out tree] in
``refit._members``. Three decisions:

* **A relay serves the bytes it pulled, in place.** Replicas of one layout build the same plan,
  hence the same receive region (``ReceiveBuffers``: every tensor and every staged pull's scratch
  at the same offset). A relay serves that region as its pull left it, before and apart from
  translate and install, which write only memory outside it (``install="copy"`` copies out of
  it, ``"swap"`` points the targets into it, a cast lands in tensors of its own), or receive
  elements that a staged pull's unstage fills and every replica fills again from its own scratch
  (Note [Install modes] in ``refit._install``); with ``"swap"`` the record names both halves of
  the double buffer and the header the one a cycle fills. The replica copies the same byte
  ranges to the same offsets (``refit._chunks``), then checks, translates and installs exactly as
  if they had come from the publishers: no second plan, no memory beyond one receiver's, no copy
  on the relay.
* **The publishers pin the version.** Every replica counts itself in at the publishers as any
  receiver does (Note [Version protocol], Note [Version board]) and pulls the version it entered,
  from a relay or from the publishers. While one replica is inside version v no publisher can
  publish v + 1, so no relay can take a newer version into what it serves: relays need no reader
  counts of their own, and the check every replica makes at the publishers after its pull (Note
  [Version header]) covers bytes that came through relays too, which were read from the
  publishers while v stood. What a replica learns from a relay is only which chunks it may copy.
* **Chunks, pipelined and checked like a seqlock.** A relay's header (``refit._relay_header``, in
  its own transfer memory, and a copy in its host's shared memory that replicas there read: Note
  [Relay header in host memory]; incarnation, epoch, version and the label of the publishers'
  generations and manifests, plan signature, served region, chunks held) says how many chunks of
  the version it holds. Before its region takes other bytes (its next pull, other buffers, close)
  a relay writes a new epoch with 0 chunks, or ``closed``; it raises the count after each chunk
  landed (and, for a chunk from its own relay, was checked). A replica reads the header, copies
  the chunks it shows, reads it again, and counts them as its own only if the incarnation,
  epoch, label and region are the same: no byte of them changed while it copied. Up to ``WINDOW``
  copies are in flight, each header read checking those that landed before it was issued, so the
  link stays busy through the header's round trip and a replica lags the one it pulls from by a
  few chunks. So no replica serves a chunk it does not hold, and every replica's chunks are the
  version it entered, whoever it copied them from; a relay's ``held`` state says its publishers'
  check passed too.

Failures. A relay that dies (its process lock is free, or the link reports it lost) or closes is
routed around: the replica keeps the chunks it holds and pulls the rest from the relay's own
source, up to the publishers, which still hold the version it is counted in at (a relay closed
while read, as at an engine's shutdown, sends its readers there for the rest of that version).
One that shows no progress for ``FanOut.stall_s`` (not yet refitting, stalled, failed) is routed
around for that cycle. A relay whose plan signature or chunking differs is refused (``LayoutError``,
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
from warmlink.errors import MetadataError, TransferError, TransferTimeout, WarmlinkError
from warmlink.pool import liveness
from warmlink.refit import _members
from warmlink.refit._relay_header import (CLOSED, EMPTY, FAILED, FILLING, HELD, RELAY_HEADER_NBYTES, RelayHeader, RelayWords,
                                          digest16)
from warmlink.refit._upstreams import RouteAround, Upstreams, land
from warmlink.rendezvous import schema
from warmlink.transport import lease_link
from warmlink.transport.base import local_identity

__all__ = ["Relay", "FanTransfer"]

log = logging.getLogger("warmlink.refit")

PUBLISHERS = "publishers"
# chunk copies in flight from one source. Each header read (a round trip, behind the chunks queued
# on a busy link) checks every copy that landed before it: with several in flight it checks several
# at once and the link stays busy meanwhile (with 2, a hop across emulated hosts took 2-15x the
# link). Fewer is a shorter lag per hop: copies in flight together land interleaved, and a replica
# serves only the chunks before its first gap (8 replicas on 4 emulated hosts: 1.13 s at 4, 1.21 s at 8)
WINDOW = 4


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
        self._sources: list[int] = []  # the members it pulls from, in order, then 0 (Note [Fan-out tree])
        self._places: dict = {}  # the places its tree was worked out from (degree 1)
        self.incarnation = secrets.randbits(63)
        self._link = None
        self._host = None  # the shared-memory link lease of the header's copy on this host, or None
        self._header: RelayHeader | None = None
        self._words: RelayWords | None = None  # what the header says now
        self._lock = threading.Lock()  # header writes: the driver's progress against a cycle's end
        self._served = None  # (state, token) of the buffers served between cycles
        self._announced: list = []  # the region descriptors the record names
        self._ups: Upstreams | None = None  # the members it pulls from, from its first cycle
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None

    # -- the receiver's calls ----------------------------------------------------------------
    def pull(self, state, plan, bufs, version: int, timeout_s: float, twin=None) -> FanTransfer:
        """Start filling ``bufs`` (the cycle's receive buffers of ``plan``) with ``version``, which
        the cycle entered at the publishers of ``state.sources``; returns once the fill is queued.
        ``twin``: the other half of a swap double buffer (the next cycle's), announced with
        ``bufs`` so that replicas open both once."""
        sources = state.sources
        regions = [bufs.region.desc] + ([twin.region.desc] if twin is not None else [])
        if self.member == 0:
            self._join(state.link, plan, bufs, regions, sources.place())
        chunk_bytes = self.config.chunk_bytes_for(plan.link_nbytes, state.link.backend)
        chunks, batches = bufs.chunked(plan, sources, chunk_bytes)
        label = digest16([sources.generations(), list(sources.digests())])
        job = _Job(bufs, chunks, batches, version, label, timeout_s)
        with self._lock:  # a new epoch before the region takes a byte of it: Note [Fan-out]
            old = self._words
            self._write(RelayWords(self.incarnation, old.epoch + 1, version, FILLING, 0, chunks.num_chunks, chunks.chunk_bytes,
                                   chunks.nbytes, label, digest16(plan.signature), digest16(bufs.region.desc)))
            self._job = job
        if bufs.region.desc not in self._announced:  # other buffers (a new plan, or pooling off): tell the store
            self._announce(regions)
        if self._thread is None:
            self._thread = threading.Thread(target=self._drive, name="warmlink-fanout", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        if twin is not None:  # the next cycle's pulls from the publishers, prepared while this one's bytes move
            try:
                twin.chunked(plan, sources, chunk_bytes)
            except WarmlinkError as exc:  # this cycle's bytes are moving: the next cycle prepares again, and raises
                log.warning("fan-out could not prepare the next cycle's pulls", extra={"error": str(exc)})
        return FanTransfer(self, job)

    def verified(self) -> None:
        """The cycle's bytes passed the publishers' check: the header says ``held``."""
        with self._lock:
            self._write(self._words._replace(state=HELD))

    def keep(self, state, token) -> None:
        """The cycle installed with ``install="copy"``: hold its buffers (``token``), which are
        served until the next cycle's header moves on, and let the previous cycle's go. (A swap
        install holds its installed half itself until the next install, which comes after the
        next pull moved the header off it.)"""
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
        if self._ups is not None:
            self._ups.close_all()
        link, self._link = self._link, None
        if link is not None:
            link.release(self._header.region)
        host, self._host = self._host, None
        if host is not None:
            host.resource.release(self._header.host)
            host.release()
        self._header = None
        served, self._served = self._served, None
        if served is not None:
            served[0].release_buffers(served[1])

    # -- joining -----------------------------------------------------------------------------
    def _join(self, link, plan, bufs, regions: list, publishers_place) -> None:
        """Take a member number and write this relay's record (Note [Fan-out tree]) naming
        ``regions``; a join that failed (the store) is tried again by the next cycle.
        ``publishers_place``: the one GPU every publisher's regions are on (``SourceSet.place``), or
        None."""
        if self._link is None:  # its header and the members it pulls from: once, given back by close
            self._link = link
            self._header = RelayHeader(link.allocate(RELAY_HEADER_NBYTES), self._host_region())
            self._ups = Upstreams(self.config, self.store, link, self.timeout_s)
        self._write(RelayWords(self.incarnation, 0, 0, EMPTY, 0, 0, 0, 0, b"", digest16(plan.signature), digest16(bufs.region.desc)))
        c = self.config
        member = self.store.add(_members.members_key(c.group, c.rank), 1, checked=False)
        if not 1 <= member < 1 << 40:
            raise MetadataError(f"Receiver.refit: store key {_members.members_key(c.group, c.rank)!r} gave member number "
                                f"{member}; expected 1 to 2**40 (a forged counter?)")
        self.member = member
        self._announce(regions)
        places = self._earlier_places() if c.degree == 1 else {}
        if publishers_place is not None:
            places[0] = publishers_place
        self._places = places
        self._sources = _members.ancestors(member, c.degree, places)
        log.info("fan-out member joined", extra={"group": c.group, "rank": c.rank, "member": self.member,
                                                  "source": self._sources[0]})

    def _earlier_places(self) -> dict:
        """The places of this member and those before it (``_members.place_of``), from their records:
        each is written just after its member took its number, so a missing one is waited for a
        little (a second in all); one still missing, or refused, counts as a place of its own."""
        c = self.config
        places = {self.member: (local_identity()[0], _members.device_id(self._link.device))}
        deadline = time.monotonic() + min(1.0, c.stall_s)
        for earlier in range(self.member - 1, 0, -1):
            peer = f"fan-out {c.group}/{c.rank} replica {earlier}"
            while True:
                try:
                    raw = self.store.try_get(_members.member_key(c.group, c.rank, earlier), peer=peer,
                                             timeout_s=max(0.1, deadline - time.monotonic()))
                    if raw is not None:
                        places[earlier] = _members.place_of(schema.decode(raw, _members.KIND, peer))
                except MetadataError as exc:
                    log.warning("fan-out record refused", extra={"source": earlier, "error": str(exc)})
                if earlier in places or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        return places

    def _host_region(self):
        """The header's copy in this host's shared memory (Note [Relay header in host memory] in
        ``refit._relay_header``), or None where there is none: its readers then read the header
        through their link."""
        try:
            self._host = lease_link("shm", -1, self.timeout_s)
            return self._host.resource.allocate(RELAY_HEADER_NBYTES)
        except (WarmlinkError, OSError) as exc:
            log.warning("fan-out header stays in link memory only", extra={"error": str(exc)})
            if self._host is not None:
                self._host.release()
            self._host = None
            return None

    def _announce(self, regions: list) -> None:
        c = self.config
        record = _members.make_record(group=c.group, rank=c.rank, member=self.member, incarnation=self.incarnation,
                                      identity=local_identity(), device=_members.device_id(self._link.device),
                                      token=liveness.token(), backend=self._link.backend,
                                      header=self._header.region.desc, regions=regions,
                                      host_header=self._header.host.desc if self._header.host is not None else None)
        self.store.set_json(_members.member_key(c.group, c.rank, self.member), record)
        self._announced = list(regions)

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
        tried: set[int] = set()  # this cycle's, routed around (stalled ones may serve the next)
        while True:
            member = next(m for m in self._sources if m not in tried and m not in self._ups.gone)  # 0 comes last
            if member == 0:
                self._from_publishers(job)
                return
            try:
                self._from_member(job, member)
                return
            except RouteAround as why:  # the chunks held so far stay: the next source gives the rest
                log.info("fan-out routes around a replica", extra={"member": self.member, "source": member, "why": str(why),
                                                                   "held": job.held})
                tried.add(member)
                if why.gone:  # for good: the tree without it (Note [Fan-out tree] in refit._members)
                    self._sources = _members.ancestors(self.member, self.config.degree, self._places, self._ups.gone)

    def _progress(self, job: _Job, held: int) -> None:
        job.held = held
        with self._lock:
            if not job.cancelled:
                self._write(self._words._replace(held=held))

    def _from_publishers(self, job: _Job) -> None:
        """Copy the chunks from ``job.held`` on from the publishers, ``WINDOW`` at most in flight:
        NIXL over UCX TCP moves the reads it has outstanding interleaved, so with every chunk issued
        at once the first 32 of 128 landed only at 0.62 s of a 0.91 s pull (a relay trace, 4
        emulated hosts), and the replicas behind this one waited that long for a chunk to copy."""
        issued, landed = [], 0  # (chunk, batch, transfer) in chunk order; the first ``landed`` waited for
        try:
            for k in range(job.held, job.chunks.num_chunks):
                if len(issued) - landed == WINDOW:
                    self._landed_from_publishers(job, *issued[landed])
                    landed += 1
                batch = job.batches[k]
                issued.append((k, batch, self._link.read(batch) if batch is not None else None))
            for entry in issued[landed:]:
                self._landed_from_publishers(job, *entry)
        finally:
            _settle([t for _, _, t in issued], job.timeout_s)

    def _landed_from_publishers(self, job: _Job, k: int, batch, transfer) -> None:
        if transfer is not None:
            transfer.wait(job.left())
            job.count(PUBLISHERS, batch.nbytes, batch.num_copies)
        self._progress(job, k + 1)

    def _from_member(self, job: _Job, member: int) -> None:
        """Copy chunks from ``member`` as it shows them held, from ``job.held`` until every chunk
        is held. Raises RouteAround when it gives no more.

        At most ``WINDOW`` chunk copies are in flight; each header read verifies the copies that had
        landed before it was issued (Note [Fan-out]) and says what the member holds now, while the
        next copy keeps the link busy. A mapping closes only once no copy reads it."""
        ups, mine = self._ups, self._words
        up = ups.get(member, job.left)
        held = job.held
        last_move, sleep_s = time.monotonic(), 50e-6
        inflight: collections.deque = collections.deque()  # (chunk, transfer), in chunk order from ``held``
        try:
            up, words = ups.current(up, job.left, mine)
            while True:
                job.left()
                if inflight or self._serves(job, words, held):
                    batches = ups.batches(up, job.bufs.region, job.chunks)
                    k = held + len(inflight)
                    while len(inflight) < WINDOW and self._serves(job, words, k):
                        inflight.append((k, self._link.read(batches[k])))
                        k += 1
                    land(inflight[0][1], job.left)
                    landed = 0
                    while landed < len(inflight) and inflight[landed][1].done():
                        landed += 1
                    after = ups.read(up, job.left, mine)
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
                    up, words = ups.current(up, job.left, mine, after)
                    continue
                if words is not None and words.state == FAILED and words.label == job.label:
                    raise RouteAround(f"{up.name} failed its pull of this version")
                if time.monotonic() - last_move > self.config.stall_s:
                    raise RouteAround(f"{up.name} showed no progress for {self.config.stall_s:.3g} s "
                                       f"({words.describe() if words is not None else 'no header'})")
                time.sleep(sleep_s)
                # A header in this host's memory costs a 128-byte read: poll it closely, so that a
                # chunk landing at the source is copied within ~0.5 ms, not after a 5 ms doze.
                sleep_s = min(2 * sleep_s, 5e-4 if up.host_header is not None else 5e-3)
                up, words = ups.current(up, job.left, mine)
        except RouteAround as exc:
            _settle([t for _, t in inflight], job.timeout_s)
            inflight.clear()
            if exc.gone:
                ups.lost(up)
            raise
        finally:
            _settle([t for _, t in inflight], job.timeout_s)

    @staticmethod
    def _serves(job: _Job, words: RelayWords | None, chunk: int) -> bool:
        """Whether ``words`` show ``chunk`` of this job's version held."""
        return (words is not None and words.state in (FILLING, HELD) and words.version == job.version
                and words.label == job.label and words.held > chunk)


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
