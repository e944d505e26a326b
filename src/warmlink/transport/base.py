"""The ``Link`` interface: batched one-sided copies between registered memory regions.

A ``Link`` connects this process to its peers. Local memory is *registered* once (exported in
place, or allocated from an arena); a peer's memory is *opened* once per peer generation from the
JSON descriptor the peer published. Copies are described as ``Copy`` records, validated and
coalesced once by ``prepare`` into a ``Batch``, and replayed every cycle with ``read`` (pull:
remote -> local) or ``write`` (push: local -> remote), which return a ``Transfer``.

Backends: ``shm`` (host processes, POSIX shared memory), ``cuda_ipc`` (one node, copy engines).

# Note [Peer identity and generation]
A peer is known by a slot key (``"publisher/1"``) plus a generation number handed out by the
rendezvous store each time an engine takes that slot, and by its process ``(host, pid,
start_time)``. Mappings are cached under ``(key, process, region)``: an engine re-created in the
same process (a new generation, the same memory) finds its mappings open, while a new process in
the slot gets fresh ones and the old process's are closed; every other peer's stay open. When a
peer's manifest changes, its mappings of regions the new manifest no longer names are closed too.
``start_time`` (clock ticks since boot, from /proc) makes a recycled pid a different process.
Pids and hostnames mean nothing across PID namespaces and containers; where a peer published its
liveness ``token`` (Note [Process locks] in ``pool.liveness``), the token decides instead.
"""

from __future__ import annotations

import abc
import contextlib
import os
import socket
import time
from dataclasses import dataclass
from typing import Sequence

from warmlink._backoff import wait_until
from warmlink.errors import ConfigError, PeerLostError, TransferTimeout

__all__ = [
    "PeerRef",
    "LocalRegion",
    "RemoteRegion",
    "Copy",
    "Batch",
    "Transfer",
    "Link",
    "device_scope",
    "local_identity",
    "process_start_time",
]


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        return -1
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22 of stat; fields[] starts at field 3


_identity: tuple[str, int, int] | None = None


def local_identity() -> tuple[str, int, int]:
    """``(host, pid, start_time)`` of this process (computed once per process: every export asks)."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[1] != pid:  # a forked child is another process
        _identity = (socket.gethostname(), pid, process_start_time(pid) or 0)
    return _identity


@dataclass(frozen=True, slots=True)
class PeerRef:
    """Who a peer is. See Note [Peer identity and generation]."""

    key: str
    generation: int
    host: str
    pid: int
    start_time: int
    token: str | None = None  # the peer's process lock (``pool.liveness.token()``), where it published one

    @property
    def process_id(self) -> str:
        """``host:pid:start_time`` (``:token`` where there is one: unique even where two PID
        namespaces give the same pid): what mappings are cached under. See Note [Peer identity and
        generation]."""
        return f"{self.host}:{self.pid}:{self.start_time}" + (f":{self.token}" if self.token else "")

    def alive(self) -> bool:
        """False when the peer runs on this host and its process is gone or was replaced.

        Peers on other hosts are reported alive; transports that reach them detect loss themselves.
        With a ``token``, its lock decides (any PID namespace or hostname sharing this host's
        /dev/shm); a token that cannot be checked here reads as alive.
        """
        if self.token is not None:
            from warmlink.pool import liveness

            return liveness.token_alive(self.token, pid=self.pid) is not False
        if self.host != local_identity()[0]:
            return True
        start = process_start_time(self.pid)
        return start is not None and (start == -1 or self.start_time in (0, start))


class LocalRegion:
    """Memory of this process registered with a link.

    Attributes:
        tensor: 1-D ``uint8`` view of the region (host or device).
        nbytes: size in bytes.
        device: CUDA device index, or -1 for host memory.
        ptr: address of byte 0 in this process.
        desc: the JSON-able descriptor peers use to open it (see ``rendezvous.schema``).
    """

    __slots__ = ("tensor", "nbytes", "device", "ptr", "desc", "_owner", "_closed")

    def __init__(self, tensor, nbytes: int, device: int, ptr: int, desc: dict, owner=None) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.device = device
        self.ptr = ptr
        self.desc = desc
        self._owner = owner
        self._closed = False

    def __repr__(self) -> str:
        return f"LocalRegion({self.desc.get('kind')}, nbytes={self.nbytes}, device={self.device}, closed={self._closed})"


class RemoteRegion:
    """A peer's region opened in this process (a mapping held in the pool)."""

    __slots__ = ("peer", "desc", "nbytes", "device", "ptr", "tensor", "_token", "_closed")

    def __init__(self, peer: PeerRef, desc: dict, nbytes: int, device: int, ptr: int, tensor, token=None) -> None:
        self.peer = peer
        self.desc = desc
        self.nbytes = nbytes
        self.device = device
        self.ptr = ptr
        self.tensor = tensor
        self._token = token
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteRegion(peer={self.peer.key}#{self.peer.generation}, nbytes={self.nbytes}, closed={self._closed})"


@dataclass(frozen=True, slots=True)
class Copy:
    """Move ``num_rows`` rows of ``row_nbytes`` between a local and a remote region.

    Row ``i`` covers local bytes ``[local_offset + i*local_pitch, ... + row_nbytes)`` and remote
    bytes ``[remote_offset + i*remote_pitch, ... + row_nbytes)``. Pitches are ignored when
    ``num_rows == 1``.
    """

    local: LocalRegion
    local_offset: int
    remote: RemoteRegion
    remote_offset: int
    row_nbytes: int
    num_rows: int = 1
    local_pitch: int = 0
    remote_pitch: int = 0

    @property
    def nbytes(self) -> int:
        return self.row_nbytes * self.num_rows


class Batch:
    """Copies validated and coalesced once, replayed by ``Link.read`` / ``Link.write``.

    ``flat`` holds 1-D copies, ``strided`` 2-D ones; ``prepared`` is backend data built once
    (pointer arrays for a batched memcpy). Build with ``Link.prepare``.
    """

    __slots__ = ("flat", "strided", "nbytes", "peers", "prepared", "num_requested", "last_s")

    def __init__(self, flat: list[Copy], strided: list[Copy], num_requested: int) -> None:
        self.flat = flat
        self.strided = strided
        self.nbytes = sum(c.nbytes for c in flat) + sum(c.nbytes for c in strided)
        self.peers = tuple({c.remote.peer: None for c in (*flat, *strided)})
        self.prepared = None
        self.num_requested = num_requested
        self.last_s: float | None = None  # how long its last transfer took to land: Note [Waiting for a replay]

    @property
    def num_copies(self) -> int:
        return len(self.flat) + len(self.strided)

    def __repr__(self) -> str:
        return f"Batch(flat={len(self.flat)}, strided={len(self.strided)}, nbytes={self.nbytes}, requested={self.num_requested})"


# Note [Waiting for a replay]
# A warm batch moves the same bytes every cycle, so its last transfer says when this one will land.
# Polling with sleeps wakes late: a sleep lasts at least the kernel's timer slack (~50 us), which
# on a 4.6 ms same-GPU refit is 1-2% of the cycle. So a replayed batch whose last transfer took at
# most _DOZE_UP_TO_S sleeps once through most of that time, then polls without sleeping for a
# while (one core, for a small share of a short transfer), then as before. The liveness probe
# runs after the doze: a dead peer is reported at most one doze (<= 85 ms) later. A first
# transfer, or a long one, waits as before. A transfer that moves only while its caller polls
# (``moves_alone`` False: NIXL over UCX without UCX threads, whose progress is the caller's
# ``done``) never dozes: its doze would add to its time, the next doze would be longer, and a
# small read repeated back to back settles at 1 / (1 - _DOZE_SHARE) = 6.7x its own time (a fan-out
# relay's header read over UCX TCP: 7-15 ms where it takes 0.5 ms polled).
_DOZE_UP_TO_S = 0.1
_DOZE_SHARE = 0.85
_SPIN_SHARE = 0.3


class Transfer(abc.ABC):
    """An in-flight batch. ``wait`` raises on timeout, peer loss or transport error."""

    moves_alone = True  # its bytes move between ``done`` calls (Note [Waiting for a replay])

    def __init__(self, batch: Batch, timeout_s: float) -> None:
        self.batch = batch
        self.timeout_s = timeout_s
        self.started_at = time.perf_counter()

    @abc.abstractmethod
    def done(self) -> bool:
        """True once every byte has landed (or the transfer failed: ``wait`` then raises)."""

    @abc.abstractmethod
    def _poll_error(self) -> BaseException | None:
        """The failure, if the transfer failed."""

    def cancel(self) -> None:
        """Stop issuing further work (best effort)."""

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done.

        Raises:
            PeerLostError: a peer of the batch died or was replaced while bytes moved.
            TransferTimeout: not done within ``timeout_s`` (default: the link's timeout).
            TransferError: the transport failed.
        """
        timeout = limit = timeout_s if timeout_s is not None else self.timeout_s
        batch = self.batch

        def lost() -> str | None:
            for peer in batch.peers:
                if not peer.alive():
                    return (f"Transfer.wait: peer={peer.key!r} (generation {peer.generation}, pid {peer.pid}) "
                            f"died with {batch.nbytes} bytes in flight")
            return None

        last, spin_s = batch.last_s, 0.0
        if self.moves_alone and last is not None and last <= _DOZE_UP_TO_S and not self.done():
            start = time.perf_counter()
            doze = self.started_at + _DOZE_SHARE * last - start
            if doze > 0:
                time.sleep(min(doze, timeout))
            timeout = max(timeout - (time.perf_counter() - start), 0.0)
            spin_s = _SPIN_SHARE * last
        try:
            # sleeps of 20 to 100 us: a longer sleep would add up to itself to a 20 ms refit
            wait_until(self.done, timeout_s=timeout, lost=lost, first_s=20e-6, cap_s=100e-6, first_probe_s=0.0,
                       spin_s=spin_s, what=lambda: (f"Transfer.wait: {batch.nbytes} bytes in {batch.num_copies} copies "
                                                    f"not done after {limit:.3f} s; peers {[p.key for p in batch.peers]}"))
        except (PeerLostError, TransferTimeout):
            self.cancel()
            raise
        err = self._poll_error()
        if err is not None:
            raise err
        batch.last_s = time.perf_counter() - self.started_at


def device_scope(device: int):
    """``device``'s primary context current (``_cuda.use_device``) for a GPU; nothing for host
    memory (``device < 0``)."""
    if device < 0:
        return contextlib.nullcontext()
    from warmlink import _cuda

    return _cuda.use_device(device)


class Link(abc.ABC):
    """One process's end of a transport. Every method names its cost; see the backends."""

    backend: str = "?"

    def __init__(self, device: int, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"Link: timeout_s={timeout_s!r} must be > 0 seconds")
        self.device = device
        self.timeout_s = timeout_s
        self._closed = False
        self._held: dict[int, LocalRegion | RemoteRegion] = {}  # regions handed out, not yet given back

    # -- regions handed out (every backend tracks them the same way) -----------------------------
    def _hold(self, region):
        self._held[id(region)] = region
        return region

    def _forget(self, region) -> bool:
        """Mark ``region`` closed and stop tracking it; False when it already was (a second
        ``release`` or ``close_region`` does nothing)."""
        if region._closed:
            return False
        region._closed = True
        self._held.pop(id(region), None)
        return True

    def _release_held(self) -> None:
        """Give back what the last user left: peer mappings first, then local regions."""
        held = list(self._held.values())
        for region in held:
            if isinstance(region, RemoteRegion):
                self.close_region(region)
        for region in held:
            if not isinstance(region, RemoteRegion):
                self.release(region)

    # -- local memory ------------------------------------------------------------------------
    @abc.abstractmethod
    def register(self, tensor) -> LocalRegion:
        """Export memory the caller owns, in place (zero copy). Cached by allocation identity.

        Raises:
            LayoutError: the memory cannot be shared by this backend (not contiguous, wrong device,
                not in a shareable allocation); callers then stage into ``allocate``.
        """

    def local_region(self, tensor) -> LocalRegion:
        """This process's ``tensor`` as the local end of copies, never announced to peers (a
        receiver pulling straight into its model's parameters). Backends whose copies need
        registered memory on both ends (nixl) register it; ``release`` gives it back.

        Raises:
            LayoutError: the link cannot copy into this tensor (another device, not contiguous).
        """
        return self.register(tensor)

    def device_scope(self):
        """A context to hold around many calls in a row (``register`` over a model's tensors): a
        GPU link makes its device current once instead of once per call. Nothing on host memory."""
        return device_scope(self.device)

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> LocalRegion:
        """A registered region of ``nbytes`` leased from the pool's arenas."""

    @abc.abstractmethod
    def release(self, region: LocalRegion) -> None:
        """Give back a region from ``register`` or ``allocate``. Safe to call twice."""

    # -- peers -------------------------------------------------------------------------------
    @abc.abstractmethod
    def open(self, peer: PeerRef, desc: dict) -> RemoteRegion:
        """Map a peer's region (validated descriptor). Cached per peer process."""

    @abc.abstractmethod
    def close_region(self, region: RemoteRegion) -> None:
        """Drop this holder's reference to a mapping. Safe to call twice."""

    def forget_peer(self, peer_key: str, keep_process: str | None = None, keep_regions=None) -> int:
        """Close cached mappings of ``peer_key`` except those of process ``keep_process`` whose region
        id is in ``keep_regions`` (all of them when None); returns how many. Every backend's."""
        from warmlink.pool.peers import forget_peer

        return forget_peer(peer_key, keep_process, keep_regions)

    @abc.abstractmethod
    def region_id(self, desc: dict) -> str:
        """What identifies a region's mapping in the cache (shm file name, IPC handle)."""

    # -- bytes -------------------------------------------------------------------------------
    def prepare(self, copies: Sequence[Copy]) -> Batch:
        """Validate bounds and coalesce once; the result is replayed each cycle.

        Copies of one batch run in no particular order (as in ``cudaMemcpyBatchAsync``): their
        destination bytes must not overlap.

        Raises:
            ConfigError: a copy reaches outside its regions or has a bad size or pitch.
        """
        from warmlink.transport._coalesce import coalesce, validate

        for idx, c in enumerate(copies):
            validate(c, idx)
        flat, strided = coalesce(copies)
        batch = Batch(flat, strided, len(copies))
        batch.prepared = self._prepare_backend(batch)
        return batch

    def _prepare_backend(self, batch: Batch):
        return None

    @abc.abstractmethod
    def read(self, batch: Batch) -> Transfer:
        """Pull: copy remote -> local for every copy of ``batch``. Returns at once."""

    @abc.abstractmethod
    def write(self, batch: Batch) -> Transfer:
        """Push: copy local -> remote for every copy of ``batch``. Returns at once."""

    def recycle(self) -> bool:
        """Make the link ready for its next user: release what the last one left (regions,
        mappings), wait (bounded) for work in flight, and report whether the link is healthy.
        The pool destroys a link whose recycle returns False. See Note [Reset before reuse]."""
        return False

    def close(self) -> None:
        """Release this link's resources back to the pool. Idempotent."""
        self._closed = True

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
