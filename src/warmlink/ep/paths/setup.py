"""What one rank of an ep group holds, set up once: the rendezvous with its peers and the leases.

``Resources`` leases this rank's region and mailbox, publishes its rank info (ep.wire.info) through
the store, opens every peer's region and mailbox, leases the streams and events a
``CudaMover`` uses, and builds the mover; ``close`` gives all of it back to the pool.
``group_store`` makes the store for the ranks of a ``torch.distributed`` group.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from warmlink import _env
from warmlink.ep.paths.comm_stream import CommStream
from warmlink.ep.paths.cuda_mover import SEND_PHASES, CudaMover
from warmlink.ep.paths.host_mover import HostMover
from warmlink.ep.wire import mailbox as mb
from warmlink.ep.wire.flags import ArrivalFlags, flags_nbytes, flags_page
from warmlink.ep.wire.info import KIND, check_config
from warmlink.ep.wire.regions import PARITIES, RegionLayout
from warmlink.errors import BackendUnavailable, ConfigError, MetadataError, PeerLostError, TransferTimeout

log = logging.getLogger("warmlink.ep")

__all__ = ["Resources", "group_store"]


class Resources:
    """This rank's region, mailbox, peers' mappings, pooled streams and events, and mover.

    Args:
        layout: the group's region layout. rank, num_ranks: this rank and the group size.
        device: CUDA device, or -1 for host memory (``backend="shm"``).
        backend: ``"cuda_ipc"`` or ``"shm"``. timeout_s: every store call's and wait's limit.
        copy_streams: ``"one"`` or ``"per-peer"`` copy streams (cuda_ipc).

    Construction leases the region and mailbox (and gives them back if it fails); ``connect``
    meets the peers (collective), and when it fails the caller calls ``close``, which gives back
    whatever was leased so far.
    """

    def __init__(self, layout: RegionLayout, rank: int, num_ranks: int, device: int, backend: str, timeout_s: float,
                 copy_streams: str) -> None:
        from warmlink.transport import lease_link

        self.layout, self.rank, self.num_ranks = layout, rank, num_ranks
        self.device, self.backend, self.timeout_s = device, backend, timeout_s
        self.copy_streams = copy_streams
        self.leases: list = []
        self.recv_stream = None
        self.comm = None  # cuda_ipc: where async_finish calls run (ep.paths.comm_stream)
        self.done_events: list[int] = []  # what async_finish records: per (op, parity), then the layout's
        self.mover = None
        self.peers: dict = {}
        self._remotes: list = []
        self._send_events: dict = {}
        self.flags: ArrivalFlags | None = None  # cuda_ipc: ep.wire.flags
        self._registered: list[int] = []  # host addresses of flag pages registered with CUDA
        self._flags_at, self._flags_bytes = flags_page(mb.mailbox_nbytes(num_ranks), num_ranks)
        self._link_lease = self._mail_lease = self._region = self._mail_region = self.link = None
        try:
            self._link_lease = lease_link(backend, device, timeout_s, **self._link_options())
            self.link = self._link_lease.resource
            self._mail_lease = lease_link("shm", -1, timeout_s)
            self._region = self.link.allocate(layout.nbytes)
            self._clear_boards()
            self._mail_region = self._mail_lease.resource.allocate(self._flags_at + self._flags_bytes)
            self._mail_region.tensor.zero_()  # the flag words too, before any peer can see them
            self.mailbox = mb.Mailbox(self._mail_region.tensor, rank, num_ranks)
        except BaseException:
            self.close()
            raise

    def _link_options(self) -> dict:
        """The data link's options: with ``copy_streams="per-peer"`` a copy stream per destination
        (up to the link's limit, then shared round-robin). One copy stream is the link default,
        so a Buffer then leases the same pooled links as refit does."""
        if self.backend != "cuda_ipc" or self.copy_streams != "per-peer" or self.num_ranks == 1:
            return {}
        from warmlink.transport.cuda_ipc import MAX_STREAMS

        return {"num_streams": min(self.num_ranks, MAX_STREAMS)}

    def _clear_boards(self) -> None:
        """Zero this rank's count boards (and stream space) before any peer can see its info. A region comes back from
        the pool with a closed Buffer's bytes, and rounds restart at 1: a board row whose round tag
        matched would let the exchange (ep.paths.sm_pushes, Note [SM sends]) take another lifecycle's
        counts instead of waiting for the peer's."""
        lay, region = self.layout, self._region.tensor
        for p in range(PARITIES):
            name = f"board.{p}"
            start = lay.offsets()[name]
            region[start:start + lay.area_rows(name) * lay.row_bytes(name)].zero_()
        if lay.stream is not None:  # its seq count starts at 1 on a zeroed space (Note [Streamed dispatch])
            region[lay.offsets()["stream"]:lay.offsets()["end"]].zero_()
        if self.device >= 0:  # done on the device before the rank info is published
            torch.cuda.current_stream(self.device).synchronize()

    def connect(self, store) -> None:
        """Publish this rank's info, open every peer's, and build the mover. Collective."""
        from warmlink.rendezvous import schema
        from warmlink.transport.base import PeerRef, local_identity

        limit_s = self.timeout_s  # each store call's own limit: Note [Store deadlines] in rendezvous.store
        generation = store.next_generation(f"ep/{self.rank}", timeout_s=limit_s)
        self.mailbox.set_generation(generation)
        # Buffers are built collectively: the n-th build of every rank forms epoch n.
        epoch = (store.add("ep/joins", 1, checked=False, timeout_s=limit_s) - 1) // self.num_ranks + 1
        host, pid, start = local_identity()
        info = {
            "schema_version": 1, "kind": KIND,
            "peer": {"schema_version": 1, "kind": "peer_info", "role": "ep", "rank": self.rank,
                     "world_size": self.num_ranks, "generation": generation, "host": host, "pid": pid,
                     "start_time": start, "device": self.device, "backend": self.backend},
            "config": self.layout.config(), "data": self._region.desc, "mailbox": self._mail_region.desc,
        }
        store.set(f"ep/{epoch}/{self.rank}", schema.encode(info), timeout_s=limit_s)
        peers, regions, mails = {}, {}, {}
        for r in range(self.num_ranks):
            if r == self.rank:
                continue
            name = f"ep/{r}"
            theirs = schema.decode(store.get(f"ep/{epoch}/{r}", timeout_s=limit_s), KIND, name)
            check_config(self.layout.config(), theirs["config"], name)
            p = theirs["peer"]
            if p["rank"] != r:
                raise MetadataError(f"ep rank info from peer={name!r}: peer.rank={p['rank']}; expected {r}")
            ref = PeerRef(f"{store.prefix}:{name}", p["generation"], p["host"], p["pid"], p["start_time"])
            self.link.forget_peer(ref.key, keep_process=ref.process_id)  # a replaced process's mappings
            peers[r] = ref
            data = self.link.open(ref, theirs["data"])
            mail = self._mail_lease.resource.open(ref, theirs["mailbox"])
            self._remotes += [(self.link, data), (self._mail_lease.resource, mail)]
            if data.nbytes < self.layout.nbytes:
                raise MetadataError(f"ep rank info from peer={name!r}: data.nbytes={data.nbytes}; expected >= {self.layout.nbytes}")
            regions[r] = data
            self.mailbox.attach(r, mail.tensor, ref)
            mails[r] = mail.tensor
        self.peers = peers
        if self.backend == "cuda_ipc":
            self._lease_send_events()
            self.flags = self._arrival_flags(mails)
            self.mover = self._cuda_mover(regions)
        else:
            self.mover = HostMover(self.layout, self.rank, self._region.tensor, {r: reg.tensor for r, reg in regions.items()})

    def _arrival_flags(self, mails: dict) -> ArrivalFlags:
        """This rank's and its peers' flag words (ep.wire.flags), registered with CUDA in this process."""
        from warmlink import _cuda

        if not _cuda.stream_memops_supported(self.device):
            raise BackendUnavailable(f"ep.Buffer: cuda:{self.device} runs no 64-bit stream memory operations "
                                     "(cuStreamWaitValue64), which the arrival flags of ep.wire.flags need")
        words = flags_nbytes(self.num_ranks) // 8

        def page(segment):
            view = segment[self._flags_at:self._flags_at + self._flags_bytes]
            address = _cuda.host_register(view.data_ptr(), view.numel())
            self._registered.append(view.data_ptr())
            return view.numpy().view(np.int64)[:words], address

        flags = ArrivalFlags(_cuda, *page(self._mail_region.tensor), self.rank, self.num_ranks, self.timeout_s,
                             self.peers)
        for r, segment in mails.items():
            flags.attach(r, *page(segment))
        return flags

    def _cuda_mover(self, regions: dict) -> CudaMover:
        from warmlink.pool.events import lease_event
        from warmlink.pool.streams import lease_stream

        # The link's copy streams (_link_options): one runs the destinations' copies back to back
        # in issue order, each at the full rate of one copy engine; per-peer streams let them
        # share the sender's egress.
        local = [lease_event(self.device) for _ in range(CudaMover.LOCAL_EVENTS)]
        done = [lease_event(self.device) for _ in range(2 * PARITIES + 1)]
        self.leases += local + done
        self.done_events = [e.resource.handle for e in done]
        # not among self.leases: close() must not order the caller's stream after it (it may
        # wait on a dead peer; ep.paths.cuda_mover, Note [Receive work on its own stream])
        self.recv_stream = lease_stream(self.device)
        return CudaMover(self.layout, self.rank, self.device, self._region.tensor,
                         {r: reg.ptr for r, reg in regions.items()}, self.link.engines,
                         self.recv_stream.resource, [e.resource.handle for e in local],
                         self._send_events, self.flags, self.peers)

    def comm_stream(self) -> CommStream:
        """The communication stream (ep.paths.comm_stream), leased by the first call that asks for it
        and kept until ``close``: a Buffer never called with ``async_finish`` holds one stream
        fewer, so its other streams keep the hardware queues they had (CUDA maps streams onto a
        few queues by creation order, and streams sharing one wait for each other's work)."""
        if self.comm is None:
            self.comm = CommStream.lease(self.device)  # not among self.leases: it may wait on the receive stream
        return self.comm

    def _lease_send_events(self) -> None:
        """The mover's send events: ``[phase.parity][d]`` is recorded once this rank's bytes of
        that phase toward rank ``d`` are issued, and only this rank waits on it (its caller's
        stream, before inputs are reused): local events, no IPC handles."""
        from warmlink.pool.events import lease_event

        for phase in SEND_PHASES:
            for p in range(PARITIES):
                leases = [lease_event(self.device) for _ in range(self.num_ranks)]
                self.leases += leases
                self._send_events[f"{phase}.{p}"] = [lease.resource.handle for lease in leases]

    def _unregister_flags(self) -> None:
        """Unregister the flag pages once no queued stream work can touch them: every stream that
        waited on one was released (``ArrivalFlags.close``), so the device drains."""
        registered, self._registered = self._registered, []
        if not registered:
            return
        from warmlink import _cuda

        torch.cuda.synchronize(self.device)
        for address in registered:
            _cuda.host_unregister(address)

    def drain(self) -> None:
        """Let this rank's queued calls end on their own (before ``close``, which releases what they
        wait on): the work on the caller's, the receive, the communication and the copy streams,
        within the timeout and while every peer lives. Releasing first would let a receive that
        still waits for a peer's rows read its area as it is, or end a peer's round (a Buffer closed
        right after its last call, as DeepEP's ``destroy`` may be); a peer that never sends costs
        the timeout, then the Buffer closes all the same. No-op without CUDA."""
        mover = self.mover
        if not isinstance(mover, CudaMover):
            return
        try:
            streams = [torch.cuda.current_stream(self.device)]
            if self.recv_stream is not None:
                streams.append(self.recv_stream.resource.torch_stream())
            if self.comm is not None:
                streams.append(self.comm.stream)
            streams += [stream.torch_stream() for stream in getattr(getattr(self.link, "engines", None), "streams", ())]
            ends = []
            for stream in streams:
                end = torch.cuda.Event()
                end.record(stream)
                ends.append(end)
            mover.poll(lambda: all(end.query() for end in ends), self.timeout_s, lambda: (
                f"ep: this rank's calls on cuda:{self.device} did not end within {self.timeout_s:.3g} s of close"))
        except (TransferTimeout, PeerLostError) as exc:  # closing all the same: the peer is gone or stalled
            log.warning("%s; closing without them", exc)
        except Exception as exc:  # a broken context: nothing left to wait for, and close must not leak
            log.warning("ep: could not wait for this rank's calls at close (%s); closing without them", exc)

    def close(self, recv_failed: bool = False) -> None:
        """Give regions, mappings, streams and events back to the pool. Idempotent. With
        ``recv_failed`` the caller's stream is not ordered after the receive stream."""
        mover, self.mover = self.mover, None
        flags, self.flags = self.flags, None
        if flags is not None:  # no stream of this rank waits on a flag any more, until forget()
            flags.close()
        if mover is not None:
            engines = getattr(self.link, "engines", None)  # cuda_ipc's (transport._copy_engines)
            if engines is not None:  # the region goes back to the pool once the copies that read it ran
                for stream in engines.streams:
                    torch.cuda.current_stream(self.device).wait_stream(stream.torch_stream())
            mover.close()
        try:
            self._unregister_flags()
        finally:
            if flags is not None:
                flags.forget()
        for link, region in self._remotes:
            link.close_region(region)
        self._remotes = []
        for lease in reversed(self.leases):
            lease.release()
        self.leases = []
        if self.comm is not None:
            self.comm.close(drain=not recv_failed)
            self.comm = None
        if self.recv_stream is not None:  # drained by the pool, or destroyed if it cannot drain
            if not recv_failed:  # its last reads of the region come before the region's reuse
                torch.cuda.current_stream(self.device).wait_stream(self.recv_stream.resource.torch_stream())
            self.recv_stream.release()
            self.recv_stream = None
        for name in ("_region", "_mail_region"):
            region = getattr(self, name, None)
            if region is not None:
                (self.link if name == "_region" else self._mail_lease.resource).release(region)
                setattr(self, name, None)
        for name in ("_mail_lease", "_link_lease"):
            lease = getattr(self, name, None)
            if lease is not None:
                lease.release()
                setattr(self, name, None)
        self.link = None


def host_id() -> int:
    """This machine's kernel boot id as a 63-bit int (processes that share it can map each other's
    memory), or a digest of the host name where there is none."""
    import hashlib
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            raw = f.read().strip().replace("-", "")
        return int(raw, 16) & ((1 << 63) - 1)
    except (OSError, ValueError):
        return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:8], "little") >> 1


def group_store(group, timeout_s: float | None, secret: str | None):
    """``(store, rank, world size)`` for the ranks of a ``torch.distributed`` group: rank 0 starts
    a store on loopback, and one ``all_gather`` of int64 rows (nothing pickled) sends its port and
    secret to the others and every rank's ``host_id`` to all. The caller owns the store. Collective
    over ``group``.

    Raises:
        ConfigError: on every rank, when the ranks are not all on one machine (ep runs within one node).
    """
    import torch.distributed as dist

    from warmlink.rendezvous import Store

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    limit = timeout_s if timeout_s is not None else _env.default_timeout_s()
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    store = (Store("127.0.0.1", 0, is_server=True, prefix="ep-group", timeout_s=limit, secret=secret)
             if rank == 0 else None)
    try:
        # a row per rank: [host id, port, secret's length, its UTF-8 bytes one per element, zeros]
        sent = [host_id()] + [0] * (2 + _env.MAX_SECRET_BYTES)
        if store is not None:
            raw = store.secret.encode("utf-8")
            sent[1: 3 + len(raw)] = [store.port, len(raw), *raw]
        mine = torch.tensor(sent, dtype=torch.int64, device=on)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=group)
        table = torch.stack(rows).cpu()
        hosts, first = table[:, 0].tolist(), table[0].tolist()
        if len(set(hosts)) > 1:
            apart = [r for r, h in enumerate(hosts) if h != hosts[0]]
            raise ConfigError(f"ep.Buffer.from_group: ranks {apart} of the group run on another machine than rank 0; "
                              "ep runs within one node (its ranks map each other's memory): build the group from "
                              "one node's ranks")
    except BaseException:
        if store is not None:
            store.close()
        raise
    if store is None:
        _, port, nbytes, *raw = first
        store = Store.connect(f"127.0.0.1:{port}", prefix="ep-group", timeout_s=limit,
                              secret=bytes(raw[:nbytes]).decode("utf-8"))
    return store, rank, world
