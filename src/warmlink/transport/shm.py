"""``shm``: the Link backend for CPU processes on one host, over POSIX shared memory.

The same protocol as ``cuda_ipc``: regions are files in /dev/shm exported once by name, opened
once per peer process with ``mmap``, and bytes move as one-sided copies. A worker thread per
link performs them (torch's ``copy_`` releases the GIL and uses its intra-op threads), in chunks,
so that a transfer can notice a dead peer, a cancel or a fault between chunks.

It is the embedded default without a GPU and the path CI tests every layer through.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import stat
import threading
from typing import Callable

from warmlink import _backoff
from warmlink.errors import ConfigError, LayoutError, MetadataError, PeerLostError, TransferError
from warmlink.pool import arenas
from warmlink.pool.peers import mapping_cache
from warmlink.pool.registrations import registration_cache
from warmlink.transport.base import Batch, Copy, Link, LocalRegion, PeerRef, RemoteRegion, Transfer

__all__ = ["ShmLink", "CHUNK_NBYTES"]

log = logging.getLogger("warmlink.transport")

CHUNK_NBYTES = 64 << 20  # between chunks a transfer checks cancel and fault hooks

# Test seam: called with the byte count of each chunk before it is copied. Fault-injection tests
# set it (in the process under test) to sleep, raise or kill a peer mid-transfer.
fault_hook: Callable[[int], None] | None = None


class _Mapping:
    __slots__ = ("mm", "tensor", "nbytes")

    def __init__(self, mm: mmap.mmap, tensor, nbytes: int) -> None:
        self.mm = mm
        self.tensor = tensor
        self.nbytes = nbytes


def _open_mapping(key) -> _Mapping:
    peer_key, process, name = key
    path = os.path.join(arenas.SHM_DIR, name)
    # The name is peer metadata: never follow a link, never block on a FIFO, and map only a
    # regular file of this user (what a peer's arena is).
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PeerLostError(
            f"ShmLink.open: peer={peer_key!r} (process {process}) region {name!r} is gone; the peer exited"
        ) from None
    except OSError as exc:
        raise MetadataError(f"ShmLink.open: peer={peer_key!r} region {name!r} cannot be opened ({exc}); expected a "
                            f"regular file of this user in {arenas.SHM_DIR}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise MetadataError(f"ShmLink.open: peer={peer_key!r} region {name!r} is not a regular file of this user; "
                                f"expected an arena the peer made in {arenas.SHM_DIR}")
        nbytes = st.st_size
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return _Mapping(mm, arenas.mapped_tensor(mm), nbytes)


def _close_mapping(m: _Mapping) -> None:
    m.tensor = None
    mm, m.mm = m.mm, None
    try:
        if mm is not None:
            mm.close()
    except BufferError:
        pass  # a view is still alive; the mapping goes with it (Note [Views keep a mapping] in pool.arenas)


def _export(key) -> dict:
    name, _generation, offset, nbytes = key
    return {"kind": "shm", "name": name, "offset": offset, "nbytes": nbytes}


_mappings = mapping_cache("shm", _open_mapping, _close_mapping)
_registrations = registration_cache("shm", _export, lambda _desc: None)


class ShmTransfer(Transfer):
    def __init__(self, batch: Batch, timeout_s: float, push: bool) -> None:
        super().__init__(batch, timeout_s)
        self.push = push
        self._done = threading.Event()
        self._cancelled = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def _poll_error(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        self._cancelled = True

    def _run(self) -> None:
        try:
            for c in self.batch.flat:
                self._copy_flat(c)
            for c in self.batch.strided:
                self._copy_strided(c)
        except BaseException as exc:  # surfaced through wait()
            if not isinstance(exc, (PeerLostError, TransferError)):
                exc = TransferError(f"ShmTransfer: copy failed: {exc!r}")
            self._error = exc
        finally:
            self._done.set()

    def _check(self, nbytes: int, peer: PeerRef) -> None:
        if self._cancelled:
            raise TransferError("ShmTransfer: cancelled")
        if fault_hook is not None:
            fault_hook(nbytes)
        if not peer.alive():
            raise PeerLostError(f"ShmTransfer: peer={peer.key!r} (pid {peer.pid}) died mid-transfer")

    def _copy_flat(self, c: Copy) -> None:
        local, remote = c.local.tensor, c.remote.tensor
        for start in range(0, c.row_nbytes, CHUNK_NBYTES):
            n = min(CHUNK_NBYTES, c.row_nbytes - start)
            self._check(n, c.remote.peer)
            lo, ro = c.local_offset + start, c.remote_offset + start
            if self.push:
                remote[ro : ro + n].copy_(local[lo : lo + n])
            else:
                local[lo : lo + n].copy_(remote[ro : ro + n])

    def _copy_strided(self, c: Copy) -> None:
        rows_per_chunk = max(1, CHUNK_NBYTES // c.row_nbytes)
        for row in range(0, c.num_rows, rows_per_chunk):
            n = min(rows_per_chunk, c.num_rows - row)
            self._check(n * c.row_nbytes, c.remote.peer)
            # as_strided's offset is absolute in the storage: add where the region's view starts
            # (a registered tensor or an opened descriptor with offset > 0 starts inside its file).
            lt, rt = c.local.tensor, c.remote.tensor
            lv = lt.as_strided((n, c.row_nbytes), (c.local_pitch, 1), lt.storage_offset() + c.local_offset + row * c.local_pitch)
            rv = rt.as_strided((n, c.row_nbytes), (c.remote_pitch, 1), rt.storage_offset() + c.remote_offset + row * c.remote_pitch)
            (rv.copy_(lv) if self.push else lv.copy_(rv))


class ShmLink(Link):
    """Link over POSIX shared memory between processes of one host.

    Args:
        timeout_s: default timeout of ``Transfer.wait``, seconds.

    Memory registered with ``register`` must already live in a shm arena of this process
    (``allocate`` or ``warmlink.pool.lease_arena("shm", ...)``); other CPU tensors raise
    LayoutError and callers stage them.
    """

    backend = "shm"

    def __init__(self, timeout_s: float, device: int = -1) -> None:
        if device != -1:
            raise ConfigError(f"ShmLink: device={device}; expected -1 (host memory)")
        super().__init__(-1, timeout_s)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = 0  # transfers submitted and not finished (worker decrements)
        self._busy_lock = threading.Lock()
        self._worker = threading.Thread(target=self._work, name="warmlink-shm-copy", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            transfer = self._queue.get()
            if transfer is None:
                return
            try:
                transfer._run()
            finally:
                with self._busy_lock:
                    self._busy -= 1

    # -- local ---------------------------------------------------------------------------------
    def register(self, tensor) -> LocalRegion:
        if tensor.device.type != "cpu":
            raise LayoutError(f"ShmLink.register: tensor on device={tensor.device}; expected cpu")
        if not tensor.is_contiguous():
            raise LayoutError(f"ShmLink.register: tensor of shape {tuple(tensor.shape)} is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        ptr = tensor.data_ptr()
        arena = arenas.find_shm_arena(ptr, nbytes)
        if arena is None:
            raise LayoutError(
                "ShmLink.register: tensor is not in shared memory; expected memory from ShmLink.allocate "
                "(the publisher stages such tensors)"
            )
        desc, token = _registrations.acquire((arena.name, arena.generation, ptr - arena.ptr, nbytes))
        flat = tensor.reshape(-1).view(__import__("torch").uint8) if nbytes else tensor
        return self._hold(LocalRegion(flat, nbytes, -1, ptr, desc, owner=("registration", token)))

    def local_region(self, tensor) -> LocalRegion:
        """Any contiguous CPU tensor: the copy thread writes it through this process's own view."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise LayoutError(f"ShmLink.local_region: tensor on {tensor.device} with strides {tensor.stride()}; "
                              "expected a contiguous CPU tensor")
        nbytes = tensor.numel() * tensor.element_size()
        flat = tensor.reshape(-1).view(__import__("torch").uint8) if nbytes else tensor
        return self._hold(LocalRegion(flat, nbytes, -1, tensor.data_ptr(), {"kind": "local"}, owner=None))

    def allocate(self, nbytes: int) -> LocalRegion:
        lease = arenas.lease_arena("shm", nbytes)
        arena = lease.resource
        desc = {"kind": "shm", "name": arena.name, "offset": 0, "nbytes": nbytes}
        return self._hold(LocalRegion(arena.tensor[:nbytes], nbytes, -1, arena.ptr, desc, owner=("arena", lease)))

    def release(self, region: LocalRegion) -> None:
        if not self._forget(region):
            return
        region.tensor = None
        if region._owner is None:  # a local region: nothing was registered or leased
            return
        kind, handle = region._owner
        (_registrations.release(handle) if kind == "registration" else handle.release())

    # -- peers ---------------------------------------------------------------------------------
    def open(self, peer: PeerRef, desc: dict) -> RemoteRegion:
        mapping, token = _mappings.acquire((peer.key, peer.process_id, desc["name"]))
        offset, nbytes = desc["offset"], desc["nbytes"]
        if offset + nbytes > mapping.nbytes:
            _mappings.release(token)
            raise LayoutError(
                f"ShmLink.open: peer={peer.key!r} region {desc['name']!r} offset={offset} + nbytes={nbytes} "
                f"> file size {mapping.nbytes}"
            )
        view = mapping.tensor[offset : offset + nbytes]
        return self._hold(RemoteRegion(peer, desc, nbytes, -1, view.data_ptr(), view, token))

    def close_region(self, region: RemoteRegion) -> None:
        if self._forget(region):
            region.tensor = None
            _mappings.release(region._token)

    def region_id(self, desc: dict) -> str:
        return desc["name"]

    # -- bytes ---------------------------------------------------------------------------------
    def _submit(self, batch: Batch, push: bool) -> ShmTransfer:
        if self._closed:
            raise TransferError("ShmLink: link is closed")
        transfer = ShmTransfer(batch, self.timeout_s, push)
        with self._busy_lock:
            self._busy += 1
        self._queue.put(transfer)
        return transfer

    def read(self, batch: Batch) -> ShmTransfer:
        return self._submit(batch, push=False)

    def write(self, batch: Batch) -> ShmTransfer:
        return self._submit(batch, push=True)

    def _drain(self) -> bool:
        """Wait (bounded by the timeout) until no transfer runs; True when idle."""
        return _backoff.poll(lambda: self._busy == 0, self.timeout_s, first_s=50e-6, cap_s=50e-6)

    def recycle(self) -> bool:
        """Idle, nothing held, worker alive: ready for the next user (bounded wait for transfers).

        A link whose transfers outlive the wait keeps its regions: giving memory back to the pool
        while a copy may still write into it would corrupt the next holder's bytes.
        """
        if not self._drain():
            return False
        self._release_held()
        return not self._closed and self._worker.is_alive()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._drain():
                self._release_held()
            else:  # see recycle(): leak the regions rather than hand out memory still being written
                log.warning("shm link closed with transfers in flight; its regions are not returned",
                            extra={"num_held": len(self._held)})
            self._queue.put(None)
            self._worker.join(timeout=self.timeout_s)
