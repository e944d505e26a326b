"""Pieces of the ``cuda_ipc`` backend that need no link: descriptors, copy method, pointer lists.

Kept apart from ``cuda_ipc.py`` so the link itself stays readable; see that module's notes.
"""

from __future__ import annotations

from typing import Callable

from warmlink import _cuda
from warmlink.errors import ConfigError, MetadataError
from warmlink.transport import _copy_kernel
from warmlink.transport.base import Batch, RemoteRegion

__all__ = ["MAX_STREAMS", "LEGACY_STREAM", "COPY_METHODS", "resolve_copy_method", "build_descriptor", "check_descriptor",
           "CudaIpcRemoteRegion", "CopyPlan"]

MAX_STREAMS = 16
LEGACY_STREAM = 1  # cudaStreamLegacy: torch's handle 0 is the legacy default stream, whatever
# default-stream mode the bindings' runtime was built with
COPY_METHODS = ("auto", "batch", "loop", "kernel")
_HEX = frozenset("0123456789abcdef")


def resolve_copy_method(copy_method: str, batch_supported: Callable[[], bool]) -> str:
    """The copy-engine method (``"batch"`` or ``"loop"``) for a ``copy_method`` argument;
    ``batch_supported()`` decides ``"auto"`` and ``"kernel"`` (whose copies the kernel cannot take,
    and copies between GPUs, still go to the copy engines).

    Raises:
        ConfigError: an unknown name, or ``"batch"`` where ``cudaMemcpyBatchAsync`` is unavailable.
    """
    if copy_method not in COPY_METHODS:
        raise ConfigError(f"CudaIpcLink: copy_method={copy_method!r} is unknown; expected one of {list(COPY_METHODS)}")
    if copy_method in ("auto", "kernel"):
        return "batch" if batch_supported() else "loop"
    if copy_method == "batch" and not batch_supported():
        raise ConfigError("CudaIpcLink: copy_method='batch' but cudaMemcpyBatchAsync is unavailable (needs "
                          "cuda-bindings, runtime and driver >= 12.8); expected 'loop' or 'auto'")
    return copy_method


def build_descriptor(handle: bytes, alloc_nbytes: int, offset: int, nbytes: int, device: int, buffer_id: int,
                     device_uuid: str) -> dict:
    """The JSON descriptor of a registered region (the ``rendezvous.schema`` format).

    Args:
        handle: 64-byte IPC handle of the allocation's base; alloc_nbytes: allocation size in bytes;
        offset: region start inside the allocation, bytes; nbytes: region size, bytes;
        device: exporter's CUDA device index (its own numbering); buffer_id: the allocation's unique
        id; device_uuid: the GPU's UUID (``_cuda.device_uuid``), which names it in every process.
    """
    desc = {"kind": "cuda_ipc", "handle": bytes(handle).hex(), "alloc_nbytes": int(alloc_nbytes),
            "offset": int(offset), "nbytes": int(nbytes), "device": int(device), "buffer_id": int(buffer_id),
            "device_uuid": device_uuid}
    check_descriptor(desc, "<local>")
    return desc


def check_descriptor(desc: dict, peer_key: str) -> None:
    """Raise MetadataError unless ``desc`` is a well-formed ``cuda_ipc`` descriptor (fail closed)."""
    where = f"CudaIpcLink.open: peer={peer_key!r}"
    if not isinstance(desc, dict) or desc.get("kind") != "cuda_ipc":
        kind = desc.get("kind") if isinstance(desc, dict) else type(desc).__name__
        raise MetadataError(f"{where} desc.kind={kind!r}; expected 'cuda_ipc'")
    handle = desc.get("handle")
    if not isinstance(handle, str) or len(handle) != 2 * _cuda.IPC_HANDLE_BYTES or not set(handle) <= _HEX:
        raise MetadataError(f"{where} desc.handle is not {2 * _cuda.IPC_HANDLE_BYTES} lowercase hex characters")
    for field in ("alloc_nbytes", "offset", "nbytes", "device", "buffer_id"):
        v = desc.get(field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise MetadataError(f"{where} desc.{field}={v!r}; expected an int >= 0")
    uuid = desc.get("device_uuid")
    if not isinstance(uuid, str) or len(uuid) != 32 or not set(uuid) <= _HEX:
        raise MetadataError(f"{where} desc.device_uuid is not 32 lowercase hex characters (a GPU's UUID)")
    if desc["nbytes"] == 0 or desc["offset"] + desc["nbytes"] > desc["alloc_nbytes"]:
        raise MetadataError(f"{where} desc offset={desc['offset']} nbytes={desc['nbytes']} alloc_nbytes="
                            f"{desc['alloc_nbytes']}; expected 0 < nbytes and offset + nbytes <= alloc_nbytes")



_TENSOR_SLOT = RemoteRegion.__dict__["tensor"]


class CudaIpcRemoteRegion(RemoteRegion):
    """A peer's region mapped through CUDA IPC; ``tensor`` is made lazily (we mostly use ``ptr``)."""

    __slots__ = ("_mapping",)

    @property
    def tensor(self):
        """1-D ``uint8`` view of the peer's bytes, on the device whose context opened the mapping
        (the link's); None once closed. Raises TransferError if torch cannot alias the pointer."""
        t = _TENSOR_SLOT.__get__(self, type(self))
        if t is None and not self._closed and getattr(self, "_mapping", None) is not None:
            t = _cuda.tensor_from_ptr(self.ptr, self.nbytes, self._mapping.device, owner=self._mapping)
            _TENSOR_SLOT.__set__(self, t)
        return t

    @tensor.setter
    def tensor(self, value) -> None:
        _TENSOR_SLOT.__set__(self, value)


class CopyPlan:
    """Pointer lists of a batch (``Batch.prepared``), built once per direction and stream count.

    ``same_device``: every remote region is memory of the link's own GPU (a colocated peer), so the
    copies may run as one kernel (Note [Copy kernel] in ``transport._copy_kernel``).
    """

    __slots__ = ("device", "flat", "strided", "same_device", "_work", "_kernels")

    def __init__(self, device: int, flat: list[tuple], strided: list[tuple], same_device: bool = False) -> None:
        self.device = device
        self.flat = flat  # (local_ptr, remote_ptr, nbytes)
        self.strided = strided  # (local_ptr, local_pitch, remote_ptr, remote_pitch, row_nbytes, num_rows)
        self.same_device = same_device
        self._work: dict = {}
        self._kernels: dict = {}

    @classmethod
    def build(cls, batch: Batch, device: int, *, kernel: bool = False) -> "CopyPlan":
        """The plan of ``batch``; with ``kernel``, also whether its peers share this GPU."""
        for idx, c in enumerate((*batch.flat, *batch.strided)):
            if c.local.desc.get("kind") not in ("cuda_ipc", "local") or c.local._closed or c.local.device != device:
                raise ConfigError(f"CudaIpcLink.prepare: copies[{idx}].local={c.local!r}; expected an open "
                                  f"cuda_ipc region of cuda:{device}")
            if not isinstance(c.remote, CudaIpcRemoteRegion) or c.remote._closed:
                raise ConfigError(f"CudaIpcLink.prepare: copies[{idx}].remote={c.remote!r}; expected an open "
                                  "region from CudaIpcLink.open")
        flat = [(c.local.ptr + c.local_offset, c.remote.ptr + c.remote_offset, c.row_nbytes) for c in batch.flat]
        strided = [(c.local.ptr + c.local_offset, c.local_pitch, c.remote.ptr + c.remote_offset, c.remote_pitch,
                    c.row_nbytes, c.num_rows) for c in batch.strided]
        # Where each mapped region's memory lives, in this process's device numbering: asked once
        # per region while preparing (setup), never per cycle.
        # The GPU's UUID, not a device index (each process numbers its visible GPUs from 0) nor the
        # pointer's attributes (memory a peer GPU exported reads as this process's device there).
        remotes = {id(c.remote): c.remote for c in (*batch.flat, *batch.strided)}
        many = len(flat) + len(strided) >= _copy_kernel.MIN_COPIES  # Note [Copy kernel]: a few stay on the engines
        same = kernel and many and all(r.desc["device_uuid"] == _cuda.device_uuid(device) for r in remotes.values())
        return cls(device, flat, strided, same)

    def kernel(self, direction: str):
        """The copies as one kernel (``transport._copy_kernel.CopyPlan``; its ``rest`` still need
        the copy engines), built once per direction."""
        plan = self._kernels.get(direction)
        if plan is None:
            read = direction == "read"
            copies = [(lp, rp, n, 1, 0, 0) if read else (rp, lp, n, 1, 0, 0) for lp, rp, n in self.flat]
            copies += [(lp, rp, w, h, lpitch, rpitch) if read else (rp, lp, w, h, rpitch, lpitch)
                       for lp, lpitch, rp, rpitch, w, h in self.strided]
            plan = self._kernels[direction] = _copy_kernel.CopyPlan(copies, device=self.device,
                                                                     chunk_nbytes=_copy_kernel.CHUNK_NBYTES)
        return plan

    def work(self, direction: str, num_streams: int, *, kernel: bool = False) -> list[tuple[list, list, list, list]]:
        """Per stream ``(dsts, srcs, sizes, memcpy2d_args)``, balanced by bytes; cached. With
        ``kernel``, only the copies the kernel leaves to the copy engines."""
        work = self._work.get((direction, num_streams, kernel))
        if work is not None:
            return work
        read = direction == "read"
        flat, strided = self.flat, self.strided
        if kernel:
            rest = self.kernel(direction).rest  # (dst, src, row_nbytes, rows, dst_pitch, src_pitch)
            flat = [(d, s, n) if read else (s, d, n) for d, s, n, rows, _, _ in rest if rows == 1]
            strided = [(d, dp, s, sp, n, rows) if read else (s, sp, d, dp, n, rows)
                       for d, s, n, rows, dp, sp in rest if rows > 1]
        work = [([], [], [], []) for _ in range(num_streams)]
        load = [0] * num_streams
        for lp, rp, n in (flat if num_streams == 1 else sorted(flat, key=lambda f: -f[2])):
            i = load.index(min(load))
            work[i][0].append(lp if read else rp)
            work[i][1].append(rp if read else lp)
            work[i][2].append(n)
            load[i] += n
        for lp, lpitch, rp, rpitch, width, height in strided:
            i = load.index(min(load))
            work[i][3].append((lp, lpitch, rp, rpitch, width, height) if read else (rp, rpitch, lp, lpitch, width, height))
            load[i] += width * height
        self._work[(direction, num_streams, kernel)] = work
        return work
