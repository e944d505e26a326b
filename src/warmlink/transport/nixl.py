"""``nixl``: the Link backend over NIXL (UCX underneath), for peers on other nodes.

A link for ``device=-1`` moves host memory (DRAM), one for a CUDA device moves that GPU's memory
(VRAM); a batch may read a peer's DRAM into local VRAM and back. Tested on CPU between two
processes, and on GPUs of one host, where UCX moves VRAM with ``cuda_ipc`` (see Note [UCX
settings on a host without GPU] in ``warmlink.transport._nixl_agent`` and docs/nixl.md).

What is paid once, and where it is kept:

* the NIXL agent: one per link, made in the constructor (0.4 s here, 1.18 s on the H200
  machine); links are pooled by ``warmlink.transport.lease_link``, so an engine re-created in the
  same process finds its agent made.
* registrations: ``allocate`` leases a shm arena and registers the *whole arena* once;
  ``register`` registers the arena a tensor lies in, or else the tensor's whole storage. Cached in
  the ``"registration"`` pool under ``(agent, base address, nbytes, owner)``.
* remote agents: ``open`` loads the peer's metadata (``agent_meta`` of its region descriptor)
  with ``add_remote_agent``, cached in the ``"peer_mapping"`` pool under ``(peer key, peer
  process, remote agent, local agent)``. A re-opened peer costs a dict and a set lookup.
* descriptor lists: ``prepare`` builds one local and one remote list per peer agent; the first
  ``read`` (or ``write``) of a batch makes its NIXL request, later ones repost it.

Completion is polled (``check_xfer_state``) by ``Transfer.done``; ``Transfer.wait`` adds the
timeout and, for peers on this host, process liveness. A peer whose agent disconnects raises
PeerLostError. ``write(batch, notify=tag)`` also tells the target: its link's
``wait_notification(tag)`` returns once the bytes have landed (NIXL notifications).

# Note [Polling NIXL]
Each ``check_xfer_state`` retires what UCX has finished, so ``done`` queries up to eight times
before ``Transfer.wait`` sleeps (20 to 100 us). Waiting by spinning instead was measured on two
H200s and gained nothing (a 290-descriptor READ of 8.8 GB: 35.5 ms spinning, 35.2 ms sleeping),
so the link spares the core. What did help is UCX threads that progress the transfer themselves:
see Note [UCX threads].

See Note [Loud fallbacks] in ``warmlink.transport._nixl_speed`` for how slow paths are caught.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref

from warmlink import _backoff, _env
from warmlink.errors import (
    BackendUnavailable,
    ConfigError,
    LayoutError,
    PeerLostError,
    SlowTransportError,
    SlowTransportWarning,
    TransferError,
)
from warmlink.pool import arenas
from warmlink.pool.peers import mapping_cache
from warmlink.pool.registrations import registration_cache
from warmlink.transport._nixl_desc import check_desc
from warmlink.transport._nixl_speed import (
    DEFAULT_MIN_GBPS,
    SPEED_CHECK_BYTES,
    floor_gbps,
    slow_causes,
    slow_message,
)
from warmlink.transport.base import (
    Batch,
    Link,
    LocalRegion,
    PeerRef,
    RemoteRegion,
    Transfer,
    device_scope,
)

__all__ = ["NixlLink", "NixlTransfer", "DEFAULT_MIN_GBPS", "SPEED_CHECK_BYTES"]

_POLLS_PER_DONE = 8

log = logging.getLogger("warmlink.transport")

_agents: dict[str, object] = {}  # local agent name -> _nixl_agent.Agent, for the caches' create()
_loading = threading.local()  # the metadata hex an open() is about to load (see _open_remote)


class _Registration:
    __slots__ = ("agent", "device", "keep", "meta_hex", "reg")

    def __init__(self, agent, reg, meta_hex: str, keep, device: int) -> None:
        self.agent, self.reg, self.meta_hex, self.keep, self.device = agent, reg, meta_hex, keep, device


class _RegKey(tuple):
    """``(agent, base, nbytes, owner)``; ``keep`` (the memory's owner, held alive) is not compared.

    ``owner`` is ``("arena", name)`` or ``"storage"`` for host memory, ``("vram", device, buffer
    id)`` for a ``cudaMalloc`` allocation (see ``warmlink.pool.registrations``).
    """

    keep = None


def _vram_device(owner) -> int:
    """The CUDA device of a registration key's owner, -1 for host memory."""
    return owner[1] if isinstance(owner, tuple) and owner[0] == "vram" else -1


def _register(key: _RegKey) -> _Registration:
    agent, base, nbytes, device = _agents[key[0]], key[1], key[2], _vram_device(key[3])
    with device_scope(device):  # UCX registers GPU memory in the device's primary context
        reg, meta_hex = agent.register(base, nbytes, "VRAM" if device >= 0 else "DRAM", max(device, 0))
    return _Registration(agent, reg, meta_hex, key.keep, device)


def _deregister(r: _Registration) -> None:
    r.keep = None
    with device_scope(r.device):
        r.agent.deregister(r.reg)


class _Remote:
    """A peer agent loaded into one local agent, and which of its metadata and ranges we checked."""

    __slots__ = ("agent", "checked", "loaded", "name")

    def __init__(self, agent, name: str) -> None:
        self.agent, self.name = agent, name
        self.loaded: set[str] = set()
        self.checked: set[tuple[int, int, str, int]] = set()  # (addr, nbytes, mem, device)


def _open_remote(key) -> _Remote:
    """Load a peer agent into local agent ``key[3]``. The metadata is not part of the key (a peer
    agent's regions each carry their own): ``NixlLink.open`` hands it over in ``_loading``."""
    peer_key, _process, name, local = key
    agent = _agents[local]
    meta_hex = _loading.meta_hex
    agent.load_remote(meta_hex, name, peer_key)
    remote = _Remote(agent, name)
    remote.loaded.add(meta_hex)
    agent.hold_remote(name)
    return remote


def _close_remote(remote: _Remote) -> None:
    remote.agent.drop_remote(remote.name)


_registrations = registration_cache("nixl", _register, _deregister)
_mappings = mapping_cache("nixl", _open_remote, _close_remote)


class _Prepared:
    """Per (peer agent, local mem, remote mem): [agent name, peer key, local list, remote list,
    descriptor count, requests by op]. ``speed_checked``: see Note [Loud fallbacks]."""

    __slots__ = ("__weakref__", "active", "groups", "released", "speed_checked", "vram", "remote_host")

    def __init__(self, groups: list, vram: bool, remote_host: bool) -> None:
        self.groups = groups
        self.released = False
        self.active: NixlTransfer | None = None
        self.speed_checked = False
        self.vram = vram
        self.remote_host = remote_host


# Note [UCX threads]
# NIXL's UCX plugin takes ``num_threads``: that many extra UCX workers, each driven by a thread of
# its own, and a batch of at least ``split_batch_size`` descriptors is cut into one chunk per
# thread. On two H200s a 290-descriptor READ of 8.8 GB took 37.5 ms (60% of the copy-engine
# peak) with NIXL's default single worker and 23.4 ms (95%) with 1, 2, 4 or 8 threads
# (BENCHMARKS.md, "Refit over NIXL"). One thread is as fast as eight, so the gain is not more
# CUDA streams but progress: a dedicated thread polls its worker without pause while a request
# is out, where the default worker belongs to NIXL's shared progress thread, which sleeps in
# poll() between CUDA IPC completions (our own polling did not help: Note [Polling NIXL]).
# Device links therefore default to 2 threads (room for two batches at once; idle threads
# block) and every batch goes to them. Host memory keeps the single worker: there UCX copies
# inline (cma) when the transfer is posted.
DEFAULT_GPU_UCX_THREADS = 2
_SPLIT_DESCS = 1  # every batch goes to the UCX threads


def _resolve_threads(ucx_threads: int | None, device: int) -> int:
    if ucx_threads is not None:
        return ucx_threads
    env = _env.nixl_threads()
    if env is not None:
        return env
    return DEFAULT_GPU_UCX_THREADS if device >= 0 else 0


def _ucx_params(threads: int) -> dict[str, str]:
    return {"num_threads": str(threads), "split_batch_size": str(_SPLIT_DESCS)} if threads else {}


class NixlTransfer(Transfer):
    """One NIXL request per group of the batch, polled by ``done``."""

    def __init__(self, batch: Batch, timeout_s: float, link: "NixlLink", xfers: list, finished: list[bool]) -> None:
        super().__init__(batch, timeout_s)
        self._link = link
        self._agent = link._agent
        self._xfers = xfers
        self._pending = [(x, peer) for (x, peer), done in zip(xfers, finished) if not done]
        self._error: BaseException | None = None
        self._finished = False
        self.moves_alone = link.ucx_threads > 0  # else UCX progresses in ``done`` only (Note [Polling NIXL])

    def done(self) -> bool:
        if self._error is not None or self._finished:
            return True
        try:
            with self._link.device_scope():
                # Each query also drives UCX's progress: see Note [Polling NIXL].
                for _ in range(_POLLS_PER_DONE):
                    self._pending = [(x, peer) for x, peer in self._pending if not self._agent.state(x, peer)]
                    if not self._pending:
                        break
        except (PeerLostError, TransferError) as exc:
            self._error = exc
            return True
        if self._pending:
            return False
        self._finished = True
        self._error = self._link._check_speed(self)
        return True

    def _poll_error(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        """NIXL cancels a request only by releasing it; the link does that at recycle or close."""


class NixlLink(Link):
    """Link over NIXL with the UCX backend, for host memory (``device=-1``) or one GPU's memory.

    Args:
        device: -1 for host memory, or the CUDA device whose memory this link registers.
        timeout_s: default timeout of ``Transfer.wait``, seconds.
        min_gbps: the slowest first transfer of a batch (>= 64 MiB) that is not reported; None
            means 5 GB/s when GPU memory is involved, no check for host memory. See Note [Loud
            fallbacks].
        on_slow: ``"warn"`` (SlowTransportWarning, once per link), ``"raise"``
            (SlowTransportError from ``wait``) or ``"ignore"``.
        ucx_threads: UCX threads of the agent, each driving a UCX worker of its own; batches are
            split across them. None: ``WARMLINK_NIXL_THREADS``, else ``DEFAULT_GPU_UCX_THREADS``
            (2) for a device link and 0 (NIXL's single worker) for host memory. 0 on GPUs costs
            about a third of the bandwidth (Note [UCX threads]).

    Raises:
        BackendUnavailable: NIXL is not installed or cannot make an agent with UCX, or CUDA is
            unavailable for a device link.

    Owns one NIXL agent, made with the device's primary CUDA context current (UCX looks for it
    then). ``register`` of a host tensor outside a shm arena keeps that tensor's storage alive
    and registered until the link closes (its registration is cached by address): prefer
    ``allocate`` for memory that comes and goes. A CUDA tensor's whole ``cudaMalloc`` allocation
    is registered once and cached by its buffer id, as ``cuda_ipc`` does.
    """

    backend = "nixl"

    def __init__(self, device: int = -1, timeout_s: float = 60.0, *, min_gbps: float | None = None,
                 on_slow: str = "warn", ucx_threads: int | None = None) -> None:
        if not isinstance(device, int) or isinstance(device, bool) or device < -1:
            raise ConfigError(f"NixlLink: device={device!r}; expected -1 (host memory) or a CUDA device index")
        if on_slow not in ("warn", "raise", "ignore"):
            raise ConfigError(f"NixlLink: on_slow={on_slow!r}; expected 'warn', 'raise' or 'ignore'")
        if min_gbps is not None and not (isinstance(min_gbps, (int, float)) and min_gbps >= 0):
            raise ConfigError(f"NixlLink: min_gbps={min_gbps!r}; expected a number >= 0 or None")
        if ucx_threads is not None and (not isinstance(ucx_threads, int) or isinstance(ucx_threads, bool)
                                        or not 0 <= ucx_threads <= 64):
            raise ConfigError(f"NixlLink: ucx_threads={ucx_threads!r}; expected an integer from 0 to 64 or None")
        super().__init__(device, timeout_s)
        self.min_gbps, self.on_slow = min_gbps, on_slow
        self.ucx_threads = _resolve_threads(ucx_threads, device)
        self._warned_slow = False
        if device >= 0:
            from warmlink import _cuda

            if not _cuda.available():
                raise BackendUnavailable(f"NixlLink: device={device} but CUDA is unavailable ({_cuda.unavailable_reason()})")
        from warmlink.transport._nixl_agent import Agent, make_agent_name

        with self.device_scope():
            self._agent = Agent(make_agent_name(), _ucx_params(self.ucx_threads))
        _agents[self._agent.name] = self._agent
        self._prepared: weakref.WeakSet[_Prepared] = weakref.WeakSet()
        self._inflight: list[NixlTransfer] = []
        self._notes: dict[str, list[bytes]] = {}
        self._not_ipc: set[int] = set()  # local VRAM allocations UCX cannot map by CUDA IPC

    @property
    def agent_name(self) -> str:
        return self._agent.name

    # -- local ---------------------------------------------------------------------------------
    def _acquire_reg(self, base: int, nbytes: int, owner, keep) -> tuple[_Registration, object]:
        key = _RegKey((self._agent.name, base, nbytes, owner))
        key.keep = keep
        return _registrations.acquire(key)

    def _desc(self, addr: int, nbytes: int, meta_hex: str, device: int) -> dict:
        return {"kind": "nixl", "agent": self._agent.name, "addr": addr, "nbytes": nbytes, "device": device,
                "mem": "DRAM" if device < 0 else "VRAM", "agent_meta": meta_hex}

    def register(self, tensor) -> LocalRegion:
        """Register a contiguous tensor in place, cached: a host tensor's shm arena or storage, or
        a CUDA tensor's whole allocation (``tensor`` must be on this link's device).

        Raises:
            LayoutError: not contiguous, empty, or on another device than the link's.
        """
        import torch

        self._check_open()
        if tensor.device.type == "cuda":
            if tensor.device.index != self.device:
                raise LayoutError(f"NixlLink.register: tensor on device={tensor.device}; this link registers "
                                  f"{'host memory' if self.device < 0 else f'cuda:{self.device}'}")
        elif tensor.device.type != "cpu":
            raise LayoutError(f"NixlLink.register: tensor on device={tensor.device}; expected cpu or cuda")
        if not tensor.is_contiguous():
            raise LayoutError(f"NixlLink.register: tensor of shape {tuple(tensor.shape)} is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise LayoutError("NixlLink.register: tensor has 0 bytes; expected at least 1")
        ptr = tensor.data_ptr()
        device = -1
        if tensor.device.type == "cuda":
            device = self.device
            reg, token = self._register_vram(ptr, nbytes)
        else:
            arena = arenas.find_shm_arena(ptr, nbytes)
            if arena is not None:
                reg, token = self._acquire_reg(arena.ptr, arena.nbytes, ("arena", arena.name), None)
            else:
                storage = tensor.untyped_storage()
                reg, token = self._acquire_reg(storage.data_ptr(), storage.nbytes(), "storage", storage)
        flat = tensor.reshape(-1).view(torch.uint8)
        region = LocalRegion(flat, nbytes, device, ptr, self._desc(ptr, nbytes, reg.meta_hex, device), owner=(token, None))
        return self._hold(region)

    def _register_vram(self, ptr: int, nbytes: int):
        """Register the whole ``cudaMalloc`` allocation under ``ptr`` (cached by buffer id). Memory
        of the VMM API (expandable segments, cudaMallocAsync) is mapped in chunks, so only the
        tensor's own range is registered, and the link says UCX may not move it fast."""
        from warmlink import _cuda

        with _cuda.use_device(self.device):
            base, size, bid, plain = _cuda.allocation(ptr)
        if plain:
            return self._acquire_reg(base, size, ("vram", self.device, bid), None)
        if bid not in self._not_ipc:
            self._not_ipc.add(bid)
            log.warning("nixl: GPU memory at %#x on cuda:%d is not plain cudaMalloc memory (expandable segments, "
                        "cudaMallocAsync or VMM); UCX's cuda_ipc may not map it and fall back to a slow path",
                        ptr, self.device)
        return self._acquire_reg(ptr, nbytes, ("vram", self.device, bid, "range"), None)

    def allocate(self, nbytes: int) -> LocalRegion:
        """``nbytes`` from a pooled arena (host shm, or ``cudaMalloc`` on the link's device),
        registered with the agent once per arena."""
        self._check_open()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ConfigError(f"NixlLink.allocate: nbytes={nbytes!r}; expected an int > 0")
        if self.device >= 0:
            lease = arenas.lease_arena("cuda", nbytes, self.device)
            try:
                region = self.register(lease.resource.tensor[:nbytes])
            except BaseException:
                lease.release()
                raise
            region._owner = (region._owner[0], lease)
            return region
        lease = arenas.lease_arena("shm", nbytes)
        arena = lease.resource
        try:
            reg, token = self._acquire_reg(arena.ptr, arena.nbytes, ("arena", arena.name), None)
        except BaseException:
            lease.release()
            raise
        desc = self._desc(arena.ptr, nbytes, reg.meta_hex, -1)
        return self._hold(LocalRegion(arena.tensor[:nbytes], nbytes, -1, arena.ptr, desc, owner=(token, lease)))

    def release(self, region: LocalRegion) -> None:
        if not self._forget(region):
            return
        token, lease = region._owner
        region.tensor = None
        _registrations.release(token)
        if lease is not None:
            lease.release()

    # -- peers ---------------------------------------------------------------------------------
    def open(self, peer: PeerRef, desc: dict) -> RemoteRegion:
        """Load the peer's agent (first time per peer process) and check the region is registered.

        Raises:
            MetadataError: a field of ``desc`` is invalid, its metadata does not parse or names
                another agent, or the range is not registered by that agent (names peer and field).
        """
        self._check_open()
        check_desc(desc, peer.key)
        name, meta_hex, addr, nbytes = desc["agent"], desc["agent_meta"], desc["addr"], desc["nbytes"]
        with self.device_scope():
            _loading.meta_hex = meta_hex
            try:
                remote, token = _mappings.acquire((peer.key, peer.process_id, name, self._agent.name))
            finally:
                _loading.meta_hex = None
            try:
                if meta_hex not in remote.loaded:  # another registration of the same peer agent
                    self._agent.load_remote(meta_hex, name, peer.key)
                    remote.loaded.add(meta_hex)
                span = (addr, nbytes, desc["mem"], desc["device"])
                if span not in remote.checked:
                    self._agent.check_remote(name, addr, nbytes, desc["mem"], desc["device"], peer.key)
                    remote.checked.add(span)
            except BaseException:
                _mappings.release(token)
                raise
        return self._hold(RemoteRegion(peer, desc, nbytes, desc["device"], addr, None, token))

    def close_region(self, region: RemoteRegion) -> None:
        if self._forget(region):
            _mappings.release(region._token)

    def region_id(self, desc: dict) -> str:
        """The peer's agent name: mappings are per agent (all its regions share one)."""
        return desc["agent"]

    # -- bytes ---------------------------------------------------------------------------------
    def _prepare_backend(self, batch: Batch) -> _Prepared:
        """One local and one remote descriptor list per (peer agent, local mem, remote mem); rows
        of 2-D copies are descriptors."""
        self._check_open()
        rows: dict[tuple[str, str, str], tuple[str, list, list]] = {}
        for c in (*batch.flat, *batch.strided):
            rdesc = c.remote.desc
            lmem = "DRAM" if c.local.device < 0 else "VRAM"
            ldev, rdev = max(c.local.device, 0), max(rdesc["device"], 0)
            _, local, remote = rows.setdefault((rdesc["agent"], lmem, rdesc["mem"]), (c.remote.peer.key, [], []))
            for i in range(c.num_rows):
                local.append((c.local.ptr + c.local_offset + i * c.local_pitch, c.row_nbytes, ldev))
                remote.append((c.remote.ptr + c.remote_offset + i * c.remote_pitch, c.row_nbytes, rdev))
        groups = []
        try:
            with self.device_scope():
                for (name, lmem, rmem), (peer_key, local, remote) in rows.items():
                    lh = self._agent.prep_dlist("", local, lmem)
                    groups.append([name, peer_key, lh, None, len(local), {}])
                    groups[-1][3] = self._agent.prep_dlist(name, remote, rmem)
        except BaseException:
            self._release_groups(groups)
            raise
        vram = any(k[1] == "VRAM" or k[2] == "VRAM" for k in rows)
        from warmlink.transport.base import local_identity

        remote_host = any(p.host != local_identity()[0] for p in batch.peers)
        prepared = _Prepared(groups, vram, remote_host)
        self._prepared.add(prepared)
        return prepared

    def _submit(self, batch: Batch, op: str, notify: bytes = b"") -> NixlTransfer:
        self._check_open()
        prepared = batch.prepared
        if not isinstance(prepared, _Prepared) or prepared.released:
            raise TransferError(f"NixlLink.{op.lower()}: batch was not prepared by this link or was released by "
                                "recycle/close; call prepare again")
        if prepared.active is not None and not prepared.active.done():
            raise TransferError(f"NixlLink.{op.lower()}: the batch's previous transfer is still in flight; wait for it")
        xfers = []
        with self.device_scope():
            for name, _peer_key, lh, rh, num_descs, requests in prepared.groups:
                x = requests.get(op)
                if x is None:
                    x = requests[op] = self._agent.make_xfer(op, lh, rh, num_descs, name)
                xfers.append((x, name))
            finished = [self._agent.post(x, name, notify) for x, name in xfers]
        transfer = NixlTransfer(batch, self.timeout_s, self, xfers, finished)
        prepared.active = transfer
        self._inflight = [t for t in self._inflight if not t.done()]
        self._inflight.append(transfer)
        return transfer

    def read(self, batch: Batch) -> NixlTransfer:
        """Pull with NIXL READ: one request per peer agent, reposted on every later read."""
        return self._submit(batch, "READ")

    def write(self, batch: Batch, notify: bytes | None = None) -> NixlTransfer:
        """Push with NIXL WRITE: one request per peer agent, reposted on every later write.

        Args:
            notify: when given (1 to 1024 bytes), every target agent of the batch receives it as a
                notification after the bytes have landed: see ``wait_notification``.
        """
        if notify is not None and not (isinstance(notify, bytes) and 0 < len(notify) <= 1024):
            raise ConfigError(f"NixlLink.write: notify={notify!r:.60}; expected 1 to 1024 bytes")
        return self._submit(batch, "WRITE", notify or b"")

    def wait_notification(self, tag: bytes, peer_agent: str | None = None, timeout_s: float | None = None) -> str:
        """Block until a notification equal to ``tag`` arrives (from ``peer_agent`` when given);
        returns the sending agent's name. Each notification is consumed once.

        Raises:
            TransferTimeout: none arrived within ``timeout_s`` (default: the link's timeout).
        """
        self._check_open()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        found: list[str] = []

        def arrived() -> bool:
            for sender, notes in self._agent.notifications().items():
                self._notes.setdefault(sender, []).extend(notes)
            for sender, notes in self._notes.items():
                if (peer_agent is None or sender == peer_agent) and tag in notes:
                    notes.remove(tag)
                    found.append(sender)
                    return True
            return False

        _backoff.wait_until(arrived, timeout_s=timeout, first_s=20e-6, cap_s=200e-6,
                            what=f"NixlLink.wait_notification: tag={tag!r:.60} from {peer_agent or 'any agent'} "
                                 f"not received after {timeout:.3f} s")
        return found[0]

    # -- loud fallbacks (Note [Loud fallbacks]) ------------------------------------------------
    def _check_speed(self, transfer: NixlTransfer) -> BaseException | None:
        prepared = transfer.batch.prepared
        if not isinstance(prepared, _Prepared) or prepared.speed_checked or transfer.batch.nbytes < SPEED_CHECK_BYTES:
            return None
        prepared.speed_checked = True
        floor = floor_gbps(self.min_gbps, prepared.vram)
        if floor <= 0 or self.on_slow == "ignore":
            return None
        took = [self._agent.duration_s(x) for x, _ in transfer._xfers]
        took = [t for t in took if t is not None]
        seconds = max(took) if took else time.perf_counter() - transfer.started_at
        gbps = transfer.batch.nbytes / max(seconds, 1e-9) / 1e9
        if gbps >= floor:
            return None
        causes = slow_causes(vram=prepared.vram, remote_host=prepared.remote_host, num_not_ipc=len(self._not_ipc),
                             ucx_tls=os.environ.get("UCX_TLS", ""))
        msg = slow_message(transfer.batch.nbytes, gbps, floor, causes)
        if self.on_slow == "raise":
            return SlowTransportError(msg)
        if not self._warned_slow:
            self._warned_slow = True
            log.warning(msg)
            warnings.warn(msg, SlowTransportWarning, stacklevel=4)
        return None

    # -- lifecycle -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("NixlLink: link is closed")

    def _release_groups(self, groups: list) -> None:
        for group in groups:
            for x in group[5].values():
                self._agent.release(x)
            for h in (group[2], group[3]):
                if h is not None:
                    self._agent.release(h)
            group[5].clear()

    def _release_prepared(self) -> None:
        for prepared in list(self._prepared):
            if not prepared.released:
                prepared.released = True
                self._release_groups(prepared.groups)
        self._prepared = weakref.WeakSet()

    def _drain(self) -> bool:
        """Wait (bounded by the timeout) until no transfer runs; True when idle."""
        def idle() -> bool:
            self._inflight = [t for t in self._inflight if not t.done()]
            return not self._inflight

        return _backoff.poll(idle, self.timeout_s, first_s=50e-6, cap_s=50e-6)

    def recycle(self) -> bool:
        """Idle and nothing held: ready for the next user. Batches of the last user are released."""
        if self._closed or not self._drain():
            return False
        self._release_prepared()
        self._release_held()
        return True

    def close(self) -> None:
        """Drain, release batches, regions, remote agents and registrations, then drop the agent."""
        if self._closed:
            return
        self._closed = True
        if not self._drain():  # see ShmLink.close: never give back memory a transfer may still write
            log.warning("nixl link closed with transfers in flight; its regions and agent are kept",
                        extra={"num_held": len(self._held), "agent": self._agent.name})
            return
        self._release_prepared()
        self._release_held()
        name = self._agent.name
        _mappings.evict(lambda k: k[3] == name)
        _registrations.evict(lambda k: k[0] == name)
        _agents.pop(name, None)
        self._agent.close()
