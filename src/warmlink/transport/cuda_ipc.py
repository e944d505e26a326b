"""The ``cuda_ipc`` backend: one node, CUDA IPC handles, bytes moved by the copy engines (no SMs).

Local memory is exported in place: the IPC handle of the *allocation* holding a tensor (a
``cudaMalloc`` segment of torch's caching allocator, or a pool arena) is cached by
``(device, base, buffer id)``. Peers' handles are opened once per peer process and cached in
``pool.peers``. Copies run on streams leased once per link from ``pool.streams``.

# Note [Copy ordering]
``read``/``write`` enqueue copies that start only after the work already queued on the *current
torch stream of the link's device* at the time of the call: an event is recorded there and every
copy stream waits on it on the GPU (no host sync). Data produced on other streams must be ordered
onto the current stream by the caller first. The peer's side is not ordered by this link: the
peer must have finished writing (or reading) its region before this process issues the copy; the
refit version protocol guarantees that. Completion: ``Transfer.wait()`` blocks the host;
``CudaIpcTransfer.stream_wait(stream)`` makes a torch stream wait on the GPU instead. Copies of
one batch run in no particular order (``cudaMemcpyBatchAsync``): their destinations must not overlap.

# Note [Mapping lifetime]
An opened peer mapping stays valid until its last ``RemoteRegion`` is closed *and* the cache drops
it (the peer's process changes, ``forget_peer``, or pooling off). Wait for transfers that use a region
before closing it: unmapping memory under an in-flight copy is a use-after-free on the GPU.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings

from warmlink import _cuda
from warmlink.errors import BackendUnavailable, ConfigError, LayoutError, MetadataError, TransferError, WarmlinkError
from warmlink.pool import peers as _peers
from warmlink.pool.arenas import lease_arena
from warmlink.pool.events import lease_event
from warmlink.pool.registrations import registration_cache
from warmlink.pool.streams import lease_stream
from warmlink.transport import _copy_kernel
from warmlink.transport._copy_engines import CopyEngines
from warmlink.transport._cuda_ipc_parts import (
    COPY_METHODS,
    LEGACY_STREAM,
    MAX_STREAMS,
    CopyPlan,
    CudaIpcRemoteRegion,
    build_descriptor,
    check_descriptor,
    resolve_copy_method,
)
from warmlink.transport.base import Batch, Link, LocalRegion, PeerRef, RemoteRegion, Transfer

__all__ = ["CudaIpcLink", "CudaIpcTransfer", "CudaIpcRemoteRegion", "CopyEngines", "COPY_METHODS", "MAX_STREAMS", "build_descriptor",
           "check_descriptor", "resolve_copy_method"]

log = logging.getLogger("warmlink.transport")

# -- process-wide caches (pool.registrations / pool.peers) ----------------------------------------
def _create_registration(key: tuple[int, int, int]) -> bytes:
    device, base, bid = key
    with _cuda.use_device(device):
        if not _cuda.is_ipc_exportable(base):
            raise LayoutError(f"CudaIpcLink.register: allocation at {base:#x} on cuda:{device} is not IPC-exportable "
                              "(expandable segments, cudaMallocAsync or VMM); expected plain cudaMalloc memory "
                              "(stage the tensor through Link.allocate())")
        handle = _cuda.ipc_get_handle(base)
    # Memory freed and re-allocated at the same address has a new buffer id: drop the stale keys.
    _registrations.evict(lambda k: k[0] == device and k[1] == base and k[2] != bid)
    return handle


class _Mapping:
    """A peer allocation opened in this process, in the context of ``device`` (the opener's)."""

    __slots__ = ("base", "device", "size")

    def __init__(self, base: int, device: int, size: int | None) -> None:
        self.base, self.device, self.size = base, device, size


def _create_mapping(key: tuple[str, int, str, int]) -> _Mapping:
    _peer_key, _generation, handle_hex, device = key
    base = _cuda.ipc_open_handle(bytes.fromhex(handle_hex), device)
    try:
        with _cuda.use_device(device):
            size: int | None = _cuda.alloc_range(base)[1]
    except TransferError:
        size = None  # bounds then rest on the descriptor alone
    return _Mapping(base, device, size)


def _destroy_mapping(mapping: _Mapping) -> None:
    _cuda.ipc_close_handle(mapping.base, mapping.device)


# IPC handles need no release (the allocation's owner frees the memory): destroy is a no-op.
_registrations = registration_cache("cuda_ipc", _create_registration, lambda _handle: None)
_mappings = _peers.mapping_cache("cuda_ipc", _create_mapping, _destroy_mapping)


class _Owner:
    """What a LocalRegion holds: a registration token and, for ``allocate``, the arena lease."""

    __slots__ = ("token", "lease")

    def __init__(self, token, lease=None) -> None:
        self.token, self.lease = token, lease

    def release(self) -> None:
        token, lease, self.token, self.lease = self.token, self.lease, None, None
        if token is not None:
            _registrations.release(token)
        if lease is not None:
            lease.release()


class CudaIpcTransfer(Transfer):
    """Copies issued on a link's streams, complete when their event is; the event returns to the pool
    as soon as ``done()`` sees it complete."""

    def __init__(self, batch: Batch, timeout_s: float, event_lease, device: int, deferred: list) -> None:
        super().__init__(batch, timeout_s)
        self.device = device
        self._lease = event_lease
        self._event = event_lease.resource.handle
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._deferred = deferred

    def done(self) -> bool:
        """True once every copy has landed (or failed: ``wait`` then raises). Non-blocking."""
        with self._lock:
            if self._lease is None:
                return True
            try:
                if not _cuda.event_query(self._event):
                    return False
            except TransferError as exc:
                self._error = exc
            lease, self._lease = self._lease, None
        lease.release()  # complete, or broken (then the pool destroys it)
        return True

    def _poll_error(self) -> BaseException | None:
        return self._error

    def stream_wait(self, torch_stream=None) -> None:
        """Make ``torch_stream`` (default: the current stream of the link's device) wait for the copies.

        Enqueues ``cudaStreamWaitEvent``; the host does not block. Work queued later on that stream
        sees every byte of this transfer. A no-op once ``done()`` returned True.

        Raises:
            TransferError: the transfer failed, or the wait could not be enqueued.
        """
        with self._lock:
            if self._lease is None:
                if self._error is not None:
                    raise self._error
                return
            if torch_stream is None:
                import torch

                torch_stream = torch.cuda.current_stream(self.device)
            handle = torch_stream.cuda_stream if hasattr(torch_stream, "cuda_stream") else int(torch_stream)
            if handle:
                _cuda.stream_wait_event(handle, self._event)
                return
            device = getattr(getattr(torch_stream, "device", None), "index", None)  # a default stream
            with _cuda.use_device(self.device if device is None else device):
                _cuda.stream_wait_event(LEGACY_STREAM, self._event)

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound now: module globals are gone at exit
        if getattr(self, "_lease", None) is None or _finalizing():
            return
        try:
            if not self.done():  # still in flight: the link releases the event once complete
                with self._lock:
                    lease, self._lease = self._lease, None
                if lease is not None:
                    self._deferred.append(lease)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"CudaIpcTransfer(nbytes={self.batch.nbytes}, copies={self.batch.num_copies}, pending={self._lease is not None})"


class CudaIpcLink(Link):
    """One process's end of the CUDA IPC transport, on one device.

    Args:
        device: CUDA device index of this process's memory and copy streams.
        timeout_s: default ``Transfer.wait`` timeout in seconds (> 0).
        num_streams: copy streams (1 to 16); copies are spread over them by bytes. One copy-engine
            stream already reaches the link peak (DESIGN.md hardware table).
        copy_method: ``"auto"`` (the default: a batch whose peers share this GPU runs as one copy
            kernel when Triton is there, Note [Copy kernel]; other copies go to the copy engines,
            ``"batch"`` when ``cudaMemcpyBatchAsync`` is available, else ``"loop"``), ``"kernel"``
            (the same, but an error without Triton), ``"batch"`` (one ``cudaMemcpyBatchAsync`` per
            stream and call) or ``"loop"`` (one ``cudaMemcpyAsync`` per copy). Strided copies on the
            copy engines use ``cudaMemcpy2DAsync``.

    Raises:
        ConfigError: a bad argument (checked before any CUDA call).
        BackendUnavailable: no CUDA device or ``cuda.bindings`` on this machine.

    Collective? No. Warm path? The constructor leases streams and events once; ``close`` returns them.
    """

    backend = "cuda_ipc"

    def __init__(self, device: int, timeout_s: float, *, num_streams: int = 1, copy_method: str = "auto",
                 peer_access: bool = False) -> None:
        self._closed = True  # until fully built: __del__ and close() then do nothing
        # Copy engines move IPC-mapped peer memory without peer access; enabling it creates a
        # context on the peer GPU (~100 ms, measured in the first refit cycle on 2 x H200), so only
        # links whose peers' memory is touched by kernels (ep) ask for it.
        self.peer_access = peer_access
        if not isinstance(device, int) or isinstance(device, bool) or device < 0:
            raise ConfigError(f"CudaIpcLink: device={device!r}; expected a CUDA device index >= 0")
        if not isinstance(num_streams, int) or isinstance(num_streams, bool) or not 1 <= num_streams <= MAX_STREAMS:
            raise ConfigError(f"CudaIpcLink: num_streams={num_streams!r}; expected an int in [1, {MAX_STREAMS}]")
        resolve_copy_method(copy_method, lambda: True)  # validate the name before touching CUDA
        super().__init__(device, timeout_s)
        self._closed = True
        if not _cuda.available():
            raise BackendUnavailable(f"CudaIpcLink: CUDA is unavailable ({_cuda.unavailable_reason()}); use the 'shm' backend")
        self.copy_method = resolve_copy_method(copy_method, _cuda.batch_supported)
        self.kernel_copies = copy_method in ("auto", "kernel") and _copy_kernel.available()
        if copy_method == "kernel" and not self.kernel_copies:
            raise ConfigError("CudaIpcLink: copy_method='kernel' but Triton is not installed; expected 'auto', 'batch' "
                              "or 'loop'")
        self.num_streams = num_streams
        self._lock = threading.Lock()
        self._deferred: list = []
        self._leases: list = []
        try:  # streams first so that close() drains them before anything else goes back
            self._leases += [lease_stream(device) for _ in range(num_streams)]
            self._leases += [lease_event(device) for _ in range(num_streams)]
        except BaseException:
            self._release_leases()
            raise
        self.engines = CopyEngines([lease.resource for lease in self._leases[:num_streams]],
                                   self._leases[num_streams].resource.handle,
                                   [lease.resource.handle for lease in self._leases[num_streams + 1:]],
                                   batched=self.copy_method == "batch")
        self._closed = False

    def __repr__(self) -> str:
        return (f"CudaIpcLink(device={self.device}, streams={getattr(self, 'num_streams', 0)}, "
                f"copy_method={getattr(self, 'copy_method', None)!r}, closed={self._closed})")

    def _check_open(self, func: str) -> None:
        if self._closed:
            raise TransferError(f"CudaIpcLink.{func}: the link on cuda:{self.device} is closed")

    # -- local memory ------------------------------------------------------------------------
    def _flat_view(self, tensor):
        import torch

        where = f"CudaIpcLink.register(cuda:{self.device})"
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{where}: tensor is a {type(tensor).__name__}; expected a torch.Tensor")
        if tensor.device.type != "cuda" or tensor.device.index != self.device:
            raise LayoutError(f"{where}: tensor.device={tensor.device}; expected cuda:{self.device} "
                              "(stage other tensors through allocate())")
        if tensor.layout != torch.strided or not tensor.is_contiguous():
            raise LayoutError(f"{where}: tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} is not "
                              "contiguous; expected a contiguous tensor (.contiguous() or stage via allocate())")
        if tensor.numel() == 0:
            raise LayoutError(f"{where}: tensor has 0 elements; expected at least 1 byte")
        return tensor.reshape(-1).view(torch.uint8)

    def register(self, tensor) -> LocalRegion:
        """Export a contiguous CUDA tensor in place (zero copy); the allocation's IPC handle is cached.

        Args:
            tensor: contiguous tensor on ``cuda:{device}`` in plain ``cudaMalloc`` memory (torch's
                default caching allocator). The caller keeps owning it; the region holds a view.

        Returns:
            A ``LocalRegion``: ``tensor`` a flat ``uint8`` view, ``desc`` the descriptor for peers.

        Raises:
            LayoutError: not a CUDA tensor of this device, not contiguous, empty, or in memory that
                cannot be exported (expandable segments, cudaMallocAsync): stage via ``allocate``.

        Warm path? The first registration of an allocation costs a ``cudaIpcGetMemHandle``
        (~37 us); later ones are cache hits (one pointer-attributes query).
        """
        self._check_open("register")
        flat = self._flat_view(tensor)
        ptr, nbytes = flat.data_ptr(), flat.numel()
        cause = None
        with _cuda.use_device(self.device):
            try:
                base, size, bid, ipc_capable = _cuda.allocation(ptr)
            except TransferError as exc:  # a range CUDA does not report (seen with cudaMallocAsync pools)
                ipc_capable, cause = False, exc
        if not ipc_capable:  # cudaMallocAsync pools, expandable segments (VMM)
            raise LayoutError(f"CudaIpcLink.register: memory at {ptr:#x} on cuda:{self.device} is not "
                              "IPC-exportable; expected plain cudaMalloc memory (stage via allocate())") from cause
        handle, token = _registrations.acquire((self.device, base, bid))
        try:
            desc = build_descriptor(handle, size, ptr - base, nbytes, self.device, bid, _cuda.device_uuid(self.device))
        except BaseException:
            _registrations.release(token)
            raise
        return self._hold(LocalRegion(flat, nbytes, self.device, ptr, desc, owner=_Owner(token)))

    def local_region(self, tensor) -> LocalRegion:
        """A contiguous tensor of this device as the local end of copies, with no IPC export."""
        self._check_open("local_region")
        flat = self._flat_view(tensor)
        return self._hold(LocalRegion(flat, flat.numel(), self.device, flat.data_ptr(), {"kind": "local"}, owner=None))

    def allocate(self, nbytes: int) -> LocalRegion:
        """A registered region of ``nbytes`` bytes in a pool arena (contents undefined); ``release``
        gives back both the registration and the arena."""
        self._check_open("allocate")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ConfigError(f"CudaIpcLink.allocate: nbytes={nbytes!r}; expected an int > 0")
        lease = lease_arena("cuda", nbytes, self.device)
        try:
            region = self.register(lease.resource.tensor[:nbytes])
        except BaseException:
            lease.release()
            raise
        region._owner.lease = lease
        return region

    def release(self, region: LocalRegion) -> None:
        """Give back a region from ``register`` or ``allocate``. Safe to call twice."""
        if region._closed:
            return
        if region.desc.get("kind") not in ("cuda_ipc", "local"):
            raise ConfigError(f"CudaIpcLink.release: region kind={region.desc.get('kind')!r}; expected 'cuda_ipc'")
        self._forget(region)
        region.tensor = None
        if region._owner is not None:
            region._owner.release()

    # -- peers -------------------------------------------------------------------------------
    def open(self, peer: PeerRef, desc: dict) -> RemoteRegion:
        """Map a peer's region; the IPC handle is opened once per peer process and cached.

        Returns:
            A ``CudaIpcRemoteRegion``: ``ptr`` is its byte 0 in this process; ``tensor`` is made on
            first access. Valid until ``close_region`` (see Note [Mapping lifetime]).

        Raises:
            MetadataError: malformed descriptor. TransferError: the handle could not be opened.

        Warm path? The first open of a handle costs ``cudaIpcOpenMemHandle`` (measured on 2 x H200:
        10 ms for one 8.8 GB allocation, 25 ms for 290 allocations of the same total); later opens
        for the same peer process are cache hits.
        """
        self._check_open("open")
        check_descriptor(desc, peer.key)
        mapping, token = _mappings.acquire((peer.key, peer.process_id, desc["handle"], self.device))
        try:
            end = desc["offset"] + desc["nbytes"]
            if mapping.size is not None and end > mapping.size:
                raise MetadataError(f"CudaIpcLink.open: peer={peer.key!r} desc offset + nbytes = {end} > mapped "
                                    f"allocation size {mapping.size}; expected the region inside its allocation")
            if self.peer_access:
                try:  # the exporter's GPU in this process's numbering: by its UUID
                    peer_device = _cuda.device_of_uuid(desc["device_uuid"])
                    if peer_device is not None and peer_device != self.device:
                        _cuda.enable_peer_access(self.device, peer_device)
                except WarmlinkError as exc:  # copies work without it; only kernels need it
                    log.warning("peer access not enabled", extra={"device": self.device, "error": str(exc)})
        except BaseException:
            _mappings.release(token)
            raise
        region = CudaIpcRemoteRegion(peer, desc, desc["nbytes"], desc["device"], mapping.base + desc["offset"], None, token)
        region._mapping = mapping
        return self._hold(region)

    def close_region(self, region: RemoteRegion) -> None:
        """Drop this holder's reference to a mapping. Safe to call twice. See Note [Mapping lifetime]."""
        if not self._forget(region):
            return
        region.tensor = None
        if isinstance(region, CudaIpcRemoteRegion):
            region._mapping = None
        if region._token is not None:
            _mappings.release(region._token)

    def region_id(self, desc: dict) -> str:
        return desc["handle"]

    # -- bytes -------------------------------------------------------------------------------
    def _prepare_backend(self, batch: Batch) -> CopyPlan:
        plan = CopyPlan.build(batch, self.device, kernel=self.kernel_copies)
        if plan.same_device:
            with _cuda.use_device(self.device):
                plan.kernel("read").compile()  # setup, not the first pull: the table and the kernel
        return plan

    def read(self, batch: Batch) -> CudaIpcTransfer:
        """Pull remote -> local for every copy of ``batch``; returns at once. See Note [Copy ordering]."""
        return self._issue(batch, "read")

    def write(self, batch: Batch) -> CudaIpcTransfer:
        """Push local -> remote for every copy of ``batch``; returns at once. See Note [Copy ordering]."""
        return self._issue(batch, "write")

    def _issue(self, batch: Batch, direction: str) -> CudaIpcTransfer:
        import torch

        plan = batch.prepared
        if not isinstance(plan, CopyPlan) or plan.device != self.device:
            plan = batch.prepared = CopyPlan.build(batch, self.device, kernel=self.kernel_copies)
        kernel = plan.kernel(direction) if plan.same_device else None
        work = plan.work(direction, self.num_streams, kernel=kernel is not None)
        engines = self.engines
        with self._lock:
            self._check_open(direction)
            self._sweep_deferred()
            done = lease_event(self.device)
            try:
                with _cuda.use_device(self.device):
                    engines.follow(torch.cuda.current_stream(self.device).cuda_stream or LEGACY_STREAM)
                    if kernel is not None:  # See Note [Copy kernel]
                        kernel.launch(engines.handles[0])
                    for idx, (dsts, srcs, sizes, strided) in enumerate(work):
                        if idx and not sizes and not strided:
                            continue
                        engines.copy(dsts, srcs, sizes, idx)
                        engines.copy_2d(strided, idx)
                        if idx:
                            engines.join(idx)
                    _cuda.event_record(done.resource.handle, engines.handles[0])
            except BaseException:
                done.release()
                raise
        return CudaIpcTransfer(batch, self.timeout_s, done, self.device, self._deferred)

    def _sweep_deferred(self) -> None:
        """Release events of transfers dropped before completion, once they complete."""
        for _ in range(len(self._deferred)):  # pop/append are atomic: __del__ may append meanwhile
            lease = self._deferred.pop(0)
            if _cuda.event_query(lease.resource.handle):
                lease.release()
            else:
                self._deferred.append(lease)

    # -- lifecycle ---------------------------------------------------------------------------
    def _release_leases(self) -> None:
        leases, self._leases = self._leases, []
        for lease in leases:  # streams first: their drain lets in-flight copies finish
            try:
                lease.release()
            except Exception as exc:
                log.warning("release failed during close", extra={"lease": repr(lease), "error": str(exc)})

    def recycle(self) -> bool:
        """Release what the last user held and check the streams drained (bounded); False if not."""
        from warmlink.pool.streams import DRAIN_TIMEOUT_S, wait_until

        if self._closed:
            return False
        # Idle first: regions are released only once no copy can still touch them.
        try:
            idle = all(wait_until(lambda s=s: _cuda.stream_query(s), DRAIN_TIMEOUT_S) for s in self.engines.handles)
        except WarmlinkError:
            return False
        if not idle:
            return False
        with self._lock:
            self._release_held()
        self._sweep_deferred()
        return True

    def close(self) -> None:
        """Drain and return streams and events, then release every region still held. Idempotent.

        Blocking? Waits for copies still in flight (bounded by ``pool.streams.DRAIN_TIMEOUT_S``).
        """
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._release_leases()
            while self._deferred:
                self._deferred.pop().release()  # bounded wait for each pending event
            self._release_held()
        super().close()

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound now: module globals are gone at exit
        if getattr(self, "_closed", True) or _finalizing():
            return
        warnings.warn(f"{self!r} was not closed; call close() or use it as a context manager", ResourceWarning, stacklevel=2)
        try:
            self.close()
        except Exception:
            pass
