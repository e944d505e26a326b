"""Thin, checked wrappers over ``cuda.bindings`` (runtime and driver), imported on first use.

Pointers, streams and events are plain ``int`` handles. Every call's status is checked:
``check`` turns a non-success ``cudaError_t`` / ``CUresult`` into ``TransferError`` (``PoolError``
for allocations) naming the error and what was being done. Importing this module imports neither
``cuda.bindings`` nor creates a CUDA context.

# Note [One primary context]
torch and ``cuda.bindings`` each carry a CUDA runtime, but both run on the driver's *primary*
context of each device, so pointers, streams and events are interchangeable between them. Calls
that depend on the current device run inside ``use_device(device)``, which enters
``torch.cuda.device(device)`` (torch's own bookkeeping stays right) and also sets the device in
the bindings' runtime. torch is initialized (``torch.cuda.init()``) before the first raw call.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import logging
import threading
from typing import NamedTuple

from warmlink.errors import BackendUnavailable, MetadataError, PoolError, TransferError

__all__ = [
    "available", "unavailable_reason", "check", "use_device", "current_device", "device_count", "malloc", "free",
    "tensor_from_ptr", "Allocation", "allocation", "alloc_range", "buffer_id", "pointer_device", "is_ipc_exportable",
    "device_uuid", "device_of_uuid",
    "ipc_get_handle", "ipc_open_handle", "ipc_close_handle", "ipc_get_event_handle", "ipc_open_event_handle", "enable_peer_access",
    "stream_create", "stream_destroy", "stream_query", "stream_synchronize", "stream_wait_event",
    "stream_priority_range", "event_create", "event_record", "event_query", "event_synchronize",
    "event_elapsed_ms", "event_destroy", "memcpy_async", "memcpy_2d_async", "memcpy_batch_async",
    "batch_supported", "IPC_HANDLE_BYTES", "host_register", "host_unregister", "stream_memops_supported",
    "stream_write_value", "stream_wait_value",
]

log = logging.getLogger("warmlink.cuda")

IPC_HANDLE_BYTES = 64
_lock = threading.Lock()
_rt = None  # cuda.bindings.runtime, set by _load()
_drv = None  # cuda.bindings.driver
_c: dict = {}  # cached enum values and prebuilt batch arguments
_torch_ready: set[int] = set()
_peer_enabled: set[tuple[int, int]] = set()


def _load():
    """Import cuda.bindings and cache the enum objects the hot path uses."""
    global _rt, _drv
    if _rt is not None:
        return _rt
    with _lock:
        if _rt is None:
            try:
                from cuda.bindings import driver, runtime
            except ImportError as exc:
                raise BackendUnavailable(
                    f"warmlink._cuda: cuda.bindings cannot be imported ({exc}); install warmlink[cuda]"
                ) from exc
            _c["kind_default"] = runtime.cudaMemcpyKind.cudaMemcpyDefault
            _c["not_ready"] = runtime.cudaError_t.cudaErrorNotReady
            _c["peer_already"] = runtime.cudaError_t.cudaErrorPeerAccessAlreadyEnabled
            _drv = driver
            _rt = runtime
    return _rt


def _error_name(err) -> str:
    """The driver's or runtime's name of ``err``; a plain int (a compiled caller's driver status,
    ep.kernels.host) is named as a ``CUresult``."""
    name = getattr(err, "name", None)
    if name is None and _drv is not None:
        try:
            name = _drv.CUresult(int(err)).name
        except ValueError:  # not a driver status
            pass
    return name or f"error {int(err)}"


def check(result, what: str, error: type[Exception] = TransferError):
    """Raise ``error`` unless ``result`` (a bindings return tuple, or a bare status) is success.

    Returns:
        ``None`` for a call with no outputs, the output for one, a tuple for several.
    """
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err:  # cudaSuccess / CUDA_SUCCESS are 0; both enums subclass int
        raise error(f"{what} failed: {_error_name(err)} ({int(err)})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


@functools.cache
def available() -> bool:
    """True when torch sees a CUDA device and ``cuda.bindings`` loads and agrees. Never raises.

    When False, ``unavailable_reason()`` says why.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            _c["why"] = "torch.cuda.is_available() is False"
            return False
        err, n = _load().cudaGetDeviceCount()
        if err or n <= 0:
            _c["why"] = f"cuda.bindings cudaGetDeviceCount returned {_error_name(err)}, {n} devices"
            return False
        return True
    except Exception as exc:  # missing driver, bindings or library: not available
        _c["why"] = f"{type(exc).__name__}: {exc}"
        return False


def unavailable_reason() -> str:
    """Why ``available()`` returned False ('' when it returned True or was not called)."""
    return _c.get("why", "")


def _ensure_torch(device: int) -> None:
    if device not in _torch_ready:
        import torch

        torch.cuda.init()
        if not 0 <= device < torch.cuda.device_count():
            raise TransferError(f"warmlink._cuda: device={device} out of range; expected 0 <= device < {torch.cuda.device_count()}")
        _torch_ready.add(device)


_inside = threading.local()  # .device: the device of the use_device this thread is inside, if any


class use_device:  # noqa: N801 - used like a function: ``with use_device(d):``
    """Make ``device`` current for torch and for the bindings' runtime. See Note [One primary context].

    Nested inside a ``use_device`` of the same device on the same thread, it does nothing: a
    caller that registers many tensors enters once instead of four driver calls per tensor.
    """

    __slots__ = ("_device", "_guard", "_previous")

    def __init__(self, device: int) -> None:
        self._device = device
        self._guard = None  # stays None when nested: nothing to undo
        self._previous = None  # the device of the use_device this one is nested in, if any

    def __enter__(self) -> "use_device":
        if getattr(_inside, "device", None) == self._device:
            return self
        import torch

        _ensure_torch(self._device)
        self._guard = torch.cuda.device(self._device)
        self._guard.__enter__()
        try:
            # The bindings' runtime keeps its own notion of the current device, which was seen not
            # to follow cudaSetDevice into cudaMalloc (memory landed on device 0). Pushing the
            # device's primary context through the driver makes every call below use it.
            check(_driver().cuCtxPushCurrent(_primary_context(self._device)), f"cuCtxPushCurrent(cuda:{self._device})")
        except BaseException:
            self._guard.__exit__(None, None, None)
            raise
        self._previous, _inside.device = getattr(_inside, "device", None), self._device
        return self

    def __exit__(self, *exc) -> None:
        if self._guard is None:
            return
        _inside.device = self._previous
        try:
            check(_drv.cuCtxPopCurrent(), f"cuCtxPopCurrent(cuda:{self._device})")
        finally:
            self._guard.__exit__(*exc)


_primary: dict[int, object] = {}


def _primary_context(device: int):
    """The primary context of ``device`` (the one torch uses), retained once per process."""
    ctx = _primary.get(device)
    if ctx is None:
        drv = _driver()
        dev = check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
        ctx = _primary[device] = check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device})")
    return ctx


def current_device() -> int:
    """The bindings' runtime current device (torch's is ``torch.cuda.current_device()``)."""
    return check((_rt or _load()).cudaGetDevice(), "cudaGetDevice")


def device_count() -> int:
    """Number of CUDA devices visible to this process (0 when none or no driver)."""
    if not available():
        return 0
    return check(_load().cudaGetDeviceCount(), "cudaGetDeviceCount")


# -- memory ---------------------------------------------------------------------------------------
def malloc(nbytes: int, device: int) -> int:
    """``cudaMalloc`` ``nbytes`` on ``device`` (plain, IPC-exportable). Caller frees with ``free``.

    Raises:
        PoolError: the allocation failed (out of memory, bad device).
    """
    with use_device(device):
        ptr = int(check(_driver().cuMemAlloc(nbytes), f"cuMemAlloc({nbytes} bytes) on cuda:{device}", PoolError))
    actual = pointer_device(ptr)
    if actual != device:
        free(ptr, actual)
        raise PoolError(f"malloc: {nbytes} bytes asked on cuda:{device} landed on cuda:{actual}")
    return ptr


def free(ptr: int, device: int) -> None:
    """``cudaFree`` a pointer from ``malloc`` (synchronizes the device)."""
    with use_device(device):
        check(_driver().cuMemFree(ptr), f"cuMemFree({ptr:#x}) on cuda:{device}", PoolError)


class _CudaBuffer:
    """Exposes raw device memory through ``__cuda_array_interface__`` and keeps ``owner`` alive."""

    __slots__ = ("ptr", "nbytes", "owner", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, owner) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.owner = owner

    @property
    def __cuda_array_interface__(self) -> dict:
        # No "stream" key: the memory is not produced on any stream torch should sync with.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "strides": None, "version": 3}


def tensor_from_ptr(ptr: int, nbytes: int, device: int, owner=None):
    """A 1-D ``uint8`` CUDA tensor aliasing ``nbytes`` at ``ptr`` on ``cuda:device``.

    The tensor does not own the memory; it keeps ``owner`` (and its interface object) referenced
    until the tensor and every view of it are gone. The caller keeps the memory valid that long.

    Raises:
        TransferError: the driver places ``ptr`` on another device (torch would copy, not alias),
            or torch did not alias the pointer.
    """
    import torch

    _ensure_torch(device)
    actual = pointer_device(ptr)
    if actual != device:
        raise TransferError(f"tensor_from_ptr: memory at {ptr:#x} belongs to cuda:{actual} for torch; expected cuda:{device}")
    buf = _CudaBuffer(ptr, nbytes, owner)
    tensor = torch.as_tensor(buf, device=torch.device("cuda", device))
    if tensor.data_ptr() != ptr or tensor.numel() != nbytes or tensor.dtype != torch.uint8:
        raise TransferError(
            f"tensor_from_ptr: torch did not alias ptr={ptr:#x} nbytes={nbytes} on cuda:{device} "
            f"(got ptr={tensor.data_ptr():#x}, numel={tensor.numel()}, device={tensor.device})"
        )
    return tensor


def _driver():
    """The driver module, after a checked ``cuInit(0)`` (idempotent; torch has usually done it)."""
    if "drv_init" not in _c:
        _load()
        check(_drv.cuInit(0), "cuInit")
        _c["drv_init"] = True
    return _drv


def _pointer_attribute(name: str, ptr: int):
    _driver()
    attr = getattr(_drv.CUpointer_attribute, name)
    return check(_drv.cuPointerGetAttribute(attr, ptr), f"cuPointerGetAttribute({name}, {ptr:#x})")


def alloc_range(ptr: int) -> tuple[int, int]:
    """``(base, size_bytes)`` of the allocation containing ``ptr`` (``cuMemGetAddressRange``)."""
    _driver()
    base, size = check(_drv.cuMemGetAddressRange(ptr), f"cuMemGetAddressRange({ptr:#x})")
    return int(base), int(size)


def buffer_id(ptr: int) -> int:
    """The allocation's unique id (``CU_POINTER_ATTRIBUTE_BUFFER_ID``); new for every cudaMalloc."""
    return int(_pointer_attribute("CU_POINTER_ATTRIBUTE_BUFFER_ID", ptr))


def pointer_device(ptr: int) -> int:
    """Device ordinal (this process's numbering) where the memory at ``ptr`` lives.

    Read through ``cudaPointerGetAttributes``: the driver attribute DEVICE_ORDINAL read through
    the bindings reported 0 for memory on cuda:1 (2 x H200, cuda-bindings 13.3).
    """
    _load()
    attrs = check(_rt.cudaPointerGetAttributes(ptr), f"cudaPointerGetAttributes({ptr:#x})")
    return int(attrs.device)


class Allocation(NamedTuple):
    """The allocation holding a pointer (see ``allocation``)."""

    base: int
    size: int
    buffer_id: int
    ipc_capable: bool


def allocation(ptr: int) -> Allocation:
    """The allocation holding ``ptr``, in one ``cuPointerGetAttributes`` call (where
    ``alloc_range`` + ``buffer_id`` + ``is_ipc_exportable`` make three): its base and size, its
    buffer id (new for every allocation) and whether ``cudaIpcGetMemHandle`` works on it (False
    for VMM memory: expandable segments, cudaMallocAsync pools).

    Raises:
        TransferError: ``ptr`` is not memory CUDA knows.
    """
    drv = _driver()
    attrs = _allocation_attrs()
    if attrs is None:  # a driver without IS_LEGACY_CUDA_IPC_CAPABLE
        base, size = alloc_range(ptr)
        return Allocation(base, size, buffer_id(base), is_ipc_exportable(base))
    base, size, bid, ipc = check(drv.cuPointerGetAttributes(len(attrs), attrs, ptr), f"cuPointerGetAttributes({ptr:#x})")
    base, size = int(base), int(size)
    if not base <= ptr < base + size:  # the plural query answers NULL for memory it does not know
        raise TransferError(f"cuPointerGetAttributes({ptr:#x}): not memory CUDA allocated, mapped or registered")
    return Allocation(base, size, int(bid), bool(ipc))


@functools.cache
def _allocation_attrs() -> list | None:
    a = _driver().CUpointer_attribute
    if not hasattr(a, "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE"):
        return None
    return [a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            a.CU_POINTER_ATTRIBUTE_BUFFER_ID, a.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE]


def is_ipc_exportable(ptr: int) -> bool:
    """Whether ``cudaIpcGetMemHandle`` works on the allocation (False for VMM / cudaMallocAsync)."""
    _driver()
    attr = getattr(_drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE", None)
    if attr is not None:
        result = _drv.cuPointerGetAttribute(attr, ptr)
        if not result[0]:
            return bool(result[1])
    err, _ = _rt.cudaIpcGetMemHandle(ptr)
    if err:
        _rt.cudaGetLastError()  # clear the runtime's last error so it does not surface later
    return not err


def ipc_get_handle(ptr: int) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` of the allocation whose *base* is ``ptr`` (~37 us)."""
    _load()
    handle = check(_rt.cudaIpcGetMemHandle(ptr), f"cudaIpcGetMemHandle({ptr:#x})")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_open_handle(handle: bytes, device: int) -> int:
    """Map a peer's allocation into this process on ``device``; returns its base address.

    Opened with ``cudaIpcMemLazyEnablePeerAccess``. Close with ``ipc_close_handle``.
    """
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
        raise MetadataError(f"ipc_open_handle: handle has {len(handle) if handle else 0} bytes; expected {IPC_HANDLE_BYTES}")
    with use_device(device):
        h = _rt.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), bytes(handle), IPC_HANDLE_BYTES)
        ptr = check(_rt.cudaIpcOpenMemHandle(h, _rt.cudaIpcMemLazyEnablePeerAccess), f"cudaIpcOpenMemHandle on cuda:{device}")
        return int(ptr)


def ipc_close_handle(ptr: int, device: int) -> None:
    """Unmap a pointer from ``ipc_open_handle``. Copies using it must have completed."""
    with use_device(device):
        check(_rt.cudaIpcCloseMemHandle(ptr), f"cudaIpcCloseMemHandle({ptr:#x}) on cuda:{device}")


@functools.cache
def device_uuid(device: int) -> str:
    """The UUID of ``device`` (this process's numbering) as 32 hex characters: the same GPU has the
    same UUID in every process, whatever ``CUDA_VISIBLE_DEVICES`` each was started with, where
    device indices differ."""
    prop = check(_load().cudaGetDeviceProperties(device), f"cudaGetDeviceProperties({device})")
    return bytes(prop.uuid.bytes).hex()


def device_of_uuid(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid`` (see ``device_uuid``), or None if not visible."""
    for device in range(device_count()):
        if device_uuid(device) == uuid:
            return device
    return None


def enable_peer_access(device: int, peer_device: int) -> bool:
    """Let kernels on ``device`` touch ``peer_device`` memory. Idempotent; False if impossible."""
    if device == peer_device or (device, peer_device) in _peer_enabled:
        return True
    with use_device(device):
        if not check(_rt.cudaDeviceCanAccessPeer(device, peer_device), f"cudaDeviceCanAccessPeer({device}, {peer_device})"):
            return False
        err = _rt.cudaDeviceEnablePeerAccess(peer_device, 0)[0]
        if err == _c["peer_already"]:
            _rt.cudaGetLastError()  # clear the tolerated error
        else:
            check(err, f"cudaDeviceEnablePeerAccess({peer_device}) on cuda:{device}")
    _peer_enabled.add((device, peer_device))
    return True


# -- streams and events ---------------------------------------------------------------------------
@functools.cache
def stream_priority_range(device: int) -> tuple[int, int]:
    """``(least, greatest)`` priority; greatest is numerically lowest (e.g. ``(0, -5)``)."""
    with use_device(device):
        least, greatest = check(_rt.cudaDeviceGetStreamPriorityRange(), "cudaDeviceGetStreamPriorityRange")
        return int(least), int(greatest)


def stream_create(device: int, priority: int = 0) -> int:
    """A non-blocking stream (``cudaStreamNonBlocking``) on ``device``; destroy with ``stream_destroy``."""
    with use_device(device):
        return int(check(_rt.cudaStreamCreateWithPriority(_rt.cudaStreamNonBlocking, priority),
                         f"cudaStreamCreateWithPriority(priority={priority}) on cuda:{device}", PoolError))


def stream_destroy(stream: int, device: int | None = None) -> None:
    """Destroy a stream; queued work still completes (the driver frees it afterwards)."""
    if device is None:
        check((_rt or _load()).cudaStreamDestroy(stream), f"cudaStreamDestroy({stream:#x})", PoolError)
        return
    with use_device(device):
        check(_rt.cudaStreamDestroy(stream), f"cudaStreamDestroy({stream:#x})", PoolError)


def stream_query(stream: int) -> bool:
    """True when every operation queued on ``stream`` has finished; False while busy.

    Raises:
        TransferError: any status other than success or ``cudaErrorNotReady`` (e.g. a sticky error).
    """
    err = (_rt or _load()).cudaStreamQuery(stream)[0]
    if not err:
        return True
    if err == _c["not_ready"]:
        return False
    return check(err, f"cudaStreamQuery({stream:#x})")


def stream_synchronize(stream: int) -> None:
    check((_rt or _load()).cudaStreamSynchronize(stream), f"cudaStreamSynchronize({stream:#x})")


def stream_wait_event(stream: int, event: int) -> None:
    """Make ``stream`` wait (on the GPU) for the work captured by ``event``'s last record."""
    err = (_rt or _load()).cudaStreamWaitEvent(stream, event, 0)[0]
    if err:  # (the message is made only then: calls on ep's launch paths)
        check(err, f"cudaStreamWaitEvent({stream:#x}, {event:#x})")


def event_create(device: int, timing: bool = False, interprocess: bool = False) -> int:
    """An event on ``device`` (``cudaEventDisableTiming`` unless ``timing``).

    ``interprocess`` adds ``cudaEventInterprocess`` so that ``ipc_get_event_handle`` can export it;
    CUDA requires such events to be made without timing.
    """
    if interprocess and timing:
        raise PoolError("event_create: an interprocess event cannot record timing (CUDA requires cudaEventDisableTiming)")
    with use_device(device):
        flags = _rt.cudaEventDefault if timing else _rt.cudaEventDisableTiming
        if interprocess:
            flags = int(flags) | int(_rt.cudaEventInterprocess)
        return int(check(_rt.cudaEventCreateWithFlags(flags), f"cudaEventCreateWithFlags on cuda:{device}", PoolError))


def ipc_get_event_handle(event: int) -> bytes:
    """The 64-byte ``cudaIpcEventHandle_t`` of an event made with ``interprocess=True``."""
    _load()
    handle = check(_rt.cudaIpcGetEventHandle(event), f"cudaIpcGetEventHandle({event:#x})")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_open_event_handle(handle: bytes, device: int) -> int:
    """Open a peer's exported event in this process; query, synchronize or wait on it like a local
    one (never record it). Destroy with ``event_destroy``."""
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
        raise MetadataError(f"ipc_open_event_handle: handle has {len(handle) if handle else 0} bytes; expected {IPC_HANDLE_BYTES}")
    with use_device(device):
        h = _rt.cudaIpcEventHandle_t()
        ctypes.memmove(h.getPtr(), bytes(handle), IPC_HANDLE_BYTES)
        return int(check(_rt.cudaIpcOpenEventHandle(h), f"cudaIpcOpenEventHandle on cuda:{device}"))


def event_record(event: int, stream: int) -> None:
    """Record ``event`` on ``stream`` (both on the same device)."""
    err = (_rt or _load()).cudaEventRecord(event, stream)[0]
    if err:
        check(err, f"cudaEventRecord({event:#x}, {stream:#x})")


def event_query(event: int) -> bool:
    """True when the work captured by ``event`` is complete (or it was never recorded)."""
    err = (_rt or _load()).cudaEventQuery(event)[0]
    if not err:
        return True
    if err == _c["not_ready"]:
        return False
    return check(err, f"cudaEventQuery({event:#x})")


def event_synchronize(event: int) -> None:
    check((_rt or _load()).cudaEventSynchronize(event), f"cudaEventSynchronize({event:#x})")


def event_elapsed_ms(start: int, end: int) -> float:
    """Milliseconds between two completed timing events."""
    return float(check((_rt or _load()).cudaEventElapsedTime(start, end), "cudaEventElapsedTime"))


def event_destroy(event: int) -> None:
    check((_rt or _load()).cudaEventDestroy(event), f"cudaEventDestroy({event:#x})", PoolError)


# -- graphs ---------------------------------------------------------------------------------------
def graph_capture(stream: int, steps) -> object:
    """The work ``steps()`` queues on ``stream``, captured into a CUDA graph and instantiated: the
    returned executable replays it with ``graph_launch``. The caller makes ``stream`` the one the
    steps launch on (torch's current stream). Thread-local capture: other threads' CUDA calls are
    unaffected; a step that raises ends the capture and nothing is kept."""
    rt = _rt or _load()
    check(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
          f"cudaStreamBeginCapture({stream:#x})")
    try:
        steps()
    except BaseException:
        err, graph = rt.cudaStreamEndCapture(stream)
        if not err and graph:
            rt.cudaGraphDestroy(graph)
        raise
    graph = check(rt.cudaStreamEndCapture(stream), f"cudaStreamEndCapture({stream:#x})")
    try:
        return check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
    finally:
        rt.cudaGraphDestroy(graph)


def graph_launch(graph_exec, stream: int) -> None:
    """Replay a ``graph_capture`` executable on ``stream`` (a few microseconds of host time)."""
    err = (_rt or _load()).cudaGraphLaunch(graph_exec, stream)[0]
    if err:
        check(err, f"cudaGraphLaunch on stream {stream:#x}")


def graph_destroy(graph_exec) -> None:
    check((_rt or _load()).cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy", PoolError)


# -- copies ---------------------------------------------------------------------------------------
def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` (kind Default, UVA) of ``nbytes`` on ``stream``."""
    err = (_rt or _load()).cudaMemcpyAsync(dst, src, nbytes, _c["kind_default"], stream)[0]
    if err:
        check(err, f"cudaMemcpyAsync(dst={dst:#x}, src={src:#x}, {nbytes} bytes)")


def memcpy_2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
    """``cudaMemcpy2DAsync``: ``height`` rows of ``width`` bytes, pitches in bytes."""
    err = (_rt or _load()).cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _c["kind_default"], stream)[0]
    if err:
        check(err, f"cudaMemcpy2DAsync(dst={dst:#x}, src={src:#x}, {height} x {width} bytes)")


@functools.cache
def batch_supported() -> bool:
    """Whether ``cudaMemcpyBatchAsync`` exists in the bindings and both runtime and driver are >= 12.8."""
    try:
        rt = _load()
        if not hasattr(rt, "cudaMemcpyBatchAsync"):
            return False
        driver = check(rt.cudaDriverGetVersion(), "cudaDriverGetVersion")
        runtime = check(rt.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
        return int(driver) >= 12080 and int(runtime) >= 12080
    except Exception as exc:  # no driver or bindings: the loop path is used
        log.debug("cudaMemcpyBatchAsync unavailable", extra={"error": str(exc)})
        return False


def _batch_args() -> tuple:
    """One attributes entry (srcAccessOrder=Stream, flags 0) and whether failIdx is an input."""
    args = _c.get("batch")
    if args is None:
        rt = _load()
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        try:  # 12.8/12.9 return failIdx as an output; guard against a binding that takes it as input
            fail_idx_in = "failIdx" in inspect.signature(rt.cudaMemcpyBatchAsync).parameters
        except (TypeError, ValueError):
            fail_idx_in = "failIdx" in (rt.cudaMemcpyBatchAsync.__doc__ or "").split("\n", 1)[0]
        args = _c["batch"] = ([attr], [0], fail_idx_in)
    return args


def memcpy_batch_async(dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> None:
    """One ``cudaMemcpyBatchAsync`` of ``len(sizes)`` copies on ``stream`` (stream-ordered sources).

    Copies within the batch are unordered; they must not overlap. Pass prebuilt lists: the bindings
    convert each element (about 0.4 us per copy of host time).
    """
    count = len(sizes)
    if count == 0:
        return
    attrs, idxs, fail_idx_in = _c.get("batch") or _batch_args()
    if fail_idx_in:
        result = _rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, idxs, 1, 0, stream)
    else:
        result = _rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, idxs, 1, stream)
    err = result[0]
    if err:
        where = f" at copy {result[1]}" if len(result) > 1 and result[1] is not None else ""
        check(err, f"cudaMemcpyBatchAsync({count} copies){where}")


# -- stream memory operations on registered host memory -------------------------------------------
# (ep.wire.flags, Note [Arrival flags]: words that other processes' streams write and this process's
# streams wait for, and that the CPU can store to with no CUDA call)
def host_register(ptr: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for every context (portable, mapped); the
    device address of its first byte. Undo with ``host_unregister``."""
    rt = _load()
    flags = rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped
    check(rt.cudaHostRegister(ptr, nbytes, flags), f"cudaHostRegister({ptr:#x}, {nbytes} bytes)")
    try:
        return int(check(rt.cudaHostGetDevicePointer(ptr, 0), f"cudaHostGetDevicePointer({ptr:#x})"))
    except BaseException:
        rt.cudaHostUnregister(ptr)
        raise


def host_unregister(ptr: int) -> None:
    check((_rt or _load()).cudaHostUnregister(ptr), f"cudaHostUnregister({ptr:#x})")


@functools.cache
def stream_memops_supported(device: int) -> bool:
    """Whether ``device`` runs 64-bit stream memory operations (``stream_write_value``/``stream_wait_value``)."""
    drv = _driver()
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    return bool(check(drv.cuDeviceGetAttribute(attr, device), f"cuDeviceGetAttribute(64-bit stream memops, {device})"))


def stream_write_value(stream: int, address: int, value: int) -> None:
    """Store the 64-bit ``value`` at device ``address`` once the work queued on ``stream`` before it
    ran, after a system-wide fence (so whoever sees the value sees that work's writes)."""
    drv = _drv or _driver()
    err = drv.cuStreamWriteValue64(stream, address, value, 0)[0]
    if err:
        check(err, f"cuStreamWriteValue64({address:#x}, {value})")


def stream_wait_value(stream: int, address: int, value: int) -> None:
    """Hold the work queued on ``stream`` after this until the 64-bit word at device ``address``
    is at least ``value`` (a cyclic comparison: values must stay within 2**63 of each other)."""
    drv = _drv or _driver()
    err = drv.cuStreamWaitValue64(stream, address, value, 0)[0]
    if err:
        check(err, f"cuStreamWaitValue64({address:#x}, {value})")
