"""``nixl``: the Link backend over NIXL (UCX underneath), for peers on other nodes.

This first form moves host memory (DRAM) only; VRAM regions are refused with LayoutError. It is
tested on CPU between two processes (see Note [UCX settings on a host without GPU] in
``warmlink.transport._nixl_agent``).

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
PeerLostError.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from warmlink.errors import ConfigError, LayoutError, PeerLostError, TransferError
from warmlink.pool import arenas
from warmlink.pool.peers import mapping_cache
from warmlink.pool.registrations import registration_cache
from warmlink.transport._nixl_desc import check_desc
from warmlink.transport.base import (
    Batch,
    Link,
    LocalRegion,
    PeerRef,
    RemoteRegion,
    Transfer,
)

__all__ = ["NixlLink", "NixlTransfer"]

log = logging.getLogger("warmlink.transport")

_agents: dict[str, object] = {}  # local agent name -> _nixl_agent.Agent, for the caches' create()
_loading = threading.local()  # the metadata hex an open() is about to load (see _open_remote)


class _Registration:
    __slots__ = ("agent", "keep", "meta_hex", "reg")

    def __init__(self, agent, reg, meta_hex: str, keep) -> None:
        self.agent, self.reg, self.meta_hex, self.keep = agent, reg, meta_hex, keep


class _RegKey(tuple):
    """``(agent, base, nbytes, owner)``; ``keep`` (the memory's owner, held alive) is not compared."""

    keep = None


def _register(key: _RegKey) -> _Registration:
    agent = _agents[key[0]]
    reg, meta_hex = agent.register_dram(key[1], key[2])
    return _Registration(agent, reg, meta_hex, key.keep)


def _deregister(r: _Registration) -> None:
    r.keep = None
    r.agent.deregister(r.reg)


class _Remote:
    """A peer agent loaded into one local agent, and which of its metadata and ranges we checked."""

    __slots__ = ("agent", "checked", "loaded", "name")

    def __init__(self, agent, name: str) -> None:
        self.agent, self.name = agent, name
        self.loaded: set[str] = set()
        self.checked: set[tuple[int, int]] = set()


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
    """Per peer agent: (agent name, peer key, local list, remote list, descriptor count, requests)."""

    __slots__ = ("__weakref__", "active", "groups", "released")

    def __init__(self, groups: list) -> None:
        self.groups = groups
        self.released = False
        self.active: NixlTransfer | None = None


class NixlTransfer(Transfer):
    """One NIXL request per peer agent of the batch, polled by ``done``."""

    def __init__(self, batch: Batch, timeout_s: float, agent, xfers: list, finished: list[bool]) -> None:
        super().__init__(batch, timeout_s)
        self._agent = agent
        self._pending = [(x, peer) for (x, peer), done in zip(xfers, finished) if not done]
        self._error: BaseException | None = None

    def done(self) -> bool:
        if self._error is not None:
            return True
        try:
            self._pending = [(x, peer) for x, peer in self._pending if not self._agent.state(x, peer)]
        except (PeerLostError, TransferError) as exc:
            self._error = exc
            return True
        return not self._pending

    def _poll_error(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        """NIXL cancels a request only by releasing it; the link does that at recycle or close."""


class NixlLink(Link):
    """Link over NIXL with the UCX backend; host memory only in this version.

    Args:
        device: -1 (host memory). CUDA devices are not supported yet (ConfigError).
        timeout_s: default timeout of ``Transfer.wait``, seconds.

    Raises:
        BackendUnavailable: NIXL is not installed or cannot make an agent with UCX.

    Owns one NIXL agent. ``register`` of a tensor outside a shm arena keeps that tensor's storage
    alive and registered until the link closes (its registration is cached by address): prefer
    ``allocate`` for memory that comes and goes.
    """

    backend = "nixl"

    def __init__(self, device: int = -1, timeout_s: float = 60.0) -> None:
        if device != -1:
            raise ConfigError(f"NixlLink: device={device}; expected -1 (host memory; VRAM is not supported yet)")
        super().__init__(-1, timeout_s)
        from warmlink.transport._nixl_agent import Agent, make_agent_name

        self._agent = Agent(make_agent_name())
        _agents[self._agent.name] = self._agent
        self._held: dict[int, object] = {}
        self._prepared: weakref.WeakSet[_Prepared] = weakref.WeakSet()
        self._inflight: list[NixlTransfer] = []

    @property
    def agent_name(self) -> str:
        return self._agent.name

    # -- local ---------------------------------------------------------------------------------
    def _acquire_reg(self, base: int, nbytes: int, owner, keep) -> tuple[_Registration, object]:
        key = _RegKey((self._agent.name, base, nbytes, owner))
        key.keep = keep
        return _registrations.acquire(key)

    def _desc(self, addr: int, nbytes: int, meta_hex: str) -> dict:
        return {"kind": "nixl", "agent": self._agent.name, "addr": addr, "nbytes": nbytes, "device": -1,
                "mem": "DRAM", "agent_meta": meta_hex}

    def register(self, tensor) -> LocalRegion:
        """Register a contiguous CPU tensor in place (its shm arena, or its whole storage), cached."""
        import torch

        self._check_open()
        if tensor.device.type != "cpu":
            raise LayoutError(f"NixlLink.register: tensor on device={tensor.device}; expected cpu (host memory only)")
        if not tensor.is_contiguous():
            raise LayoutError(f"NixlLink.register: tensor of shape {tuple(tensor.shape)} is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise LayoutError("NixlLink.register: tensor has 0 bytes; expected at least 1")
        ptr = tensor.data_ptr()
        arena = arenas.find_shm_arena(ptr, nbytes)
        if arena is not None:
            reg, token = self._acquire_reg(arena.ptr, arena.nbytes, ("arena", arena.name), None)
        else:
            storage = tensor.untyped_storage()
            reg, token = self._acquire_reg(storage.data_ptr(), storage.nbytes(), "storage", storage)
        flat = tensor.reshape(-1).view(torch.uint8)
        region = LocalRegion(flat, nbytes, -1, ptr, self._desc(ptr, nbytes, reg.meta_hex), owner=(token, None))
        return self._hold(region)

    def allocate(self, nbytes: int) -> LocalRegion:
        """``nbytes`` of host memory from a pooled shm arena, registered with the agent once per arena."""
        self._check_open()
        lease = arenas.lease_arena("shm", nbytes)
        arena = lease.resource
        try:
            reg, token = self._acquire_reg(arena.ptr, arena.nbytes, ("arena", arena.name), None)
        except BaseException:
            lease.release()
            raise
        desc = self._desc(arena.ptr, nbytes, reg.meta_hex)
        return self._hold(LocalRegion(arena.tensor[:nbytes], nbytes, -1, arena.ptr, desc, owner=(token, lease)))

    def _hold(self, region):
        self._held[id(region)] = region
        return region

    def release(self, region: LocalRegion) -> None:
        if region._closed:
            return
        region._closed = True
        self._held.pop(id(region), None)
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
            LayoutError: a VRAM region (not supported yet).
        """
        self._check_open()
        check_desc(desc, peer.key)
        if desc["mem"] != "DRAM":
            raise LayoutError(f"NixlLink.open: peer={peer.key!r} region mem={desc['mem']!r}; only DRAM is supported yet")
        name, meta_hex, addr, nbytes = desc["agent"], desc["agent_meta"], desc["addr"], desc["nbytes"]
        _loading.meta_hex = meta_hex
        try:
            remote, token = _mappings.acquire((peer.key, peer.process_id, name, self._agent.name))
        finally:
            _loading.meta_hex = None
        try:
            if meta_hex not in remote.loaded:  # another registration of the same peer agent
                self._agent.load_remote(meta_hex, name, peer.key)
                remote.loaded.add(meta_hex)
            if (addr, nbytes) not in remote.checked:
                self._agent.check_remote(name, addr, nbytes, peer.key)
                remote.checked.add((addr, nbytes))
        except BaseException:
            _mappings.release(token)
            raise
        return self._hold(RemoteRegion(peer, desc, nbytes, -1, addr, None, token))

    def close_region(self, region: RemoteRegion) -> None:
        if not region._closed:
            region._closed = True
            self._held.pop(id(region), None)
            _mappings.release(region._token)

    def region_id(self, desc: dict) -> str:
        """The peer's agent name: mappings are per agent (all its regions share one)."""
        return desc["agent"]

    # -- bytes ---------------------------------------------------------------------------------
    def _prepare_backend(self, batch: Batch) -> _Prepared:
        """One local and one remote descriptor list per peer agent; rows of 2-D copies are descriptors."""
        self._check_open()
        rows: dict[str, tuple[str, list, list]] = {}
        for c in (*batch.flat, *batch.strided):
            name = c.remote.desc["agent"]
            _, local, remote = rows.setdefault(name, (c.remote.peer.key, [], []))
            for i in range(c.num_rows):
                local.append((c.local.ptr + c.local_offset + i * c.local_pitch, c.row_nbytes, 0))
                remote.append((c.remote.ptr + c.remote_offset + i * c.remote_pitch, c.row_nbytes, 0))
        groups = []
        try:
            for name, (peer_key, local, remote) in rows.items():
                lh = self._agent.prep_dlist("", local)
                groups.append([name, peer_key, lh, None, len(local), {}])
                groups[-1][3] = self._agent.prep_dlist(name, remote)
        except BaseException:
            self._release_groups(groups)
            raise
        prepared = _Prepared(groups)
        self._prepared.add(prepared)
        return prepared

    def _submit(self, batch: Batch, op: str) -> NixlTransfer:
        self._check_open()
        prepared = batch.prepared
        if not isinstance(prepared, _Prepared) or prepared.released:
            raise TransferError(f"NixlLink.{op.lower()}: batch was not prepared by this link or was released by "
                                "recycle/close; call prepare again")
        if prepared.active is not None and not prepared.active.done():
            raise TransferError(f"NixlLink.{op.lower()}: the batch's previous transfer is still in flight; wait for it")
        xfers = []
        for name, _peer_key, lh, rh, num_descs, requests in prepared.groups:
            x = requests.get(op)
            if x is None:
                x = requests[op] = self._agent.make_xfer(op, lh, rh, num_descs, name)
            xfers.append((x, name))
        finished = [self._agent.post(x, name) for x, name in xfers]
        transfer = NixlTransfer(batch, self.timeout_s, self._agent, xfers, finished)
        prepared.active = transfer
        self._inflight = [t for t in self._inflight if not t.done()]
        self._inflight.append(transfer)
        return transfer

    def read(self, batch: Batch) -> NixlTransfer:
        """Pull with NIXL READ: one request per peer agent, reposted on every later read."""
        return self._submit(batch, "READ")

    def write(self, batch: Batch) -> NixlTransfer:
        """Push with NIXL WRITE: one request per peer agent, reposted on every later write."""
        return self._submit(batch, "WRITE")

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

    def _release_held(self) -> None:
        for region in list(self._held.values()):
            (self.close_region if isinstance(region, RemoteRegion) else self.release)(region)

    def _drain(self) -> bool:
        """Wait (bounded by the timeout) until no transfer runs; True when idle."""
        deadline = time.perf_counter() + self.timeout_s
        while True:
            self._inflight = [t for t in self._inflight if not t.done()]
            if not self._inflight or time.perf_counter() > deadline:
                return not self._inflight
            time.sleep(50e-6)

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
