"""Transfer arenas: large allocations that can be shared with other processes.

Two kinds:

* ``"shm"``: host memory in a POSIX shared-memory file (``/dev/shm/wl-<pid>-<hex8>-<n>``), mapped with
  ``mmap``. Peers open it by name. The CPU path and the one CI tests.
* ``"cuda"``: device memory from plain ``cudaMalloc`` (never expandable segments nor
  ``cudaMallocAsync``: only plain allocations export reliably as CUDA IPC handles and register
  with RDMA NICs).

Arenas are leased from the pool by ``(kind, device, rounded nbytes)`` and come back with their
``generation`` bumped, so that anything keyed on an arena's old contents is visibly stale.

# Note [Leaked shm files]
A process that dies without closing its arenas leaves files in /dev/shm. Their names carry the
creating process's tag (``<tag>-<n>``, see Note [Process locks] in ``pool.liveness``), and
``reap_orphaned_shm()`` removes the files of every tag whose lock is free: the owner is dead,
whatever PID namespace, container or hostname it had. It never removes a file whose owner holds
its lock, and skips, with one warning, what it may not remove (a directory, a symlink, another
user's file). It runs before the first shm arena of a process is created and then every
``REAP_INTERVAL_S`` on a daemon thread, so a long-lived process reaps too. A process that exits
normally unlinks its own files at exit (registered with its lock, before anything can fail);
peers that mapped them keep their mappings, and a later ``open`` fails with PeerLostError, as
for any peer that left.

# Note [Reserved shm]
A file only truncated to size has no pages: tmpfs finds them at the first touch, and when
/dev/shm is full (64 MiB is Docker's default) that touch is a SIGBUS that kills the process.
Arenas are reserved with ``posix_fallocate`` before anyone sees their name, so no space is a
PoolError naming the bytes wanted and free, the half-made file is removed, and nothing has been
published. The pages are zeroed once there, where the first touch would have zeroed them anyway.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import logging
import mmap
import os
import stat
import threading
import time

from warmlink.pool import liveness
from warmlink.pool.core import FreeList, Lease
from warmlink.errors import ConfigError, PoolError

__all__ = ["Arena", "lease_arena", "mapped_tensor", "round_up", "ARENA_ALIGN_BYTES", "SHM_DIR", "REAP_INTERVAL_S",
           "reap_orphaned_shm", "shm_prefix", "shm_free_bytes"]

log = logging.getLogger("warmlink.pool")

ARENA_ALIGN_BYTES = 2 << 20  # 2 MiB: the granularity of CUDA IPC and of huge pages
SHM_DIR = liveness.SHM_DIR
REAP_INTERVAL_S = 60.0  # a long-lived process reaps leftovers this often (Note [Leaked shm files])
_counter = itertools.count()
_started_pid: int | None = None  # the process that registered its exit cleanup and reaper thread
_start_lock = threading.Lock()
_live_lock = threading.Lock()
_live_shm: dict[str, "Arena"] = {}


def round_up(nbytes: int, align: int = ARENA_ALIGN_BYTES) -> int:
    return max(align, (nbytes + align - 1) // align * align)


def shm_prefix() -> str:
    """What this process's shm file names start with (``<tag>-``; takes the process lock)."""
    return f"{liveness.own_tag()}-"


def shm_free_bytes() -> tuple[int, int] | None:
    """``(free, total)`` bytes of the filesystem holding ``SHM_DIR``, or None when it is missing."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class Arena:
    """One shareable allocation. ``tensor`` is a 1-D ``uint8`` view of all ``nbytes``.

    Owned by the pool: users hold a ``Lease`` and never free it themselves.
    """

    __slots__ = ("kind", "device", "nbytes", "tensor", "ptr", "name", "generation", "_owner")

    def __init__(self, kind: str, device: int, nbytes: int, tensor, ptr: int, name: str | None, owner) -> None:
        self.kind = kind
        self.device = device
        self.nbytes = nbytes
        self.tensor = tensor
        self.ptr = ptr
        self.name = name
        self.generation = 1
        self._owner = owner

    def __repr__(self) -> str:
        where = self.name or hex(self.ptr)
        return f"Arena({self.kind}, device={self.device}, nbytes={self.nbytes}, at={where}, generation={self.generation})"


# -- shm ------------------------------------------------------------------------------------------
class _ShmOwner:
    __slots__ = ("name", "mm")

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self.mm = mm


# Note [Views keep a mapping]
# ``torch.frombuffer(mmap)`` takes no buffer export: ``mmap.close()`` then unmaps the memory under
# every tensor viewing it, and a later write through one lands wherever the address was reused (a
# malloc arena: glibc aborts on the damaged heap, or nothing is noticed at all). A tensor made
# through NumPy holds the export (NumPy keeps the buffer, the tensor keeps the array), so closing
# the mmap while a view lives raises BufferError, and the memory is unmapped with the last view.
def mapped_tensor(mm: mmap.mmap):
    """``mm`` as a uint8 CPU tensor that keeps the mapping while it or a view of it lives (Note
    [Views keep a mapping])."""
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


def reap_orphaned_shm() -> int:
    """Remove shm files left by dead warmlink processes; returns how many. Never raises.

    See Note [Leaked shm files]. Blocking? Lists ``SHM_DIR`` and checks one lock per owner.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    by_tag: dict[str, list[str]] = {}
    for name in names:
        m = liveness.TAGGED_NAME.fullmatch(name)
        if m is not None:
            by_tag.setdefault(m["tag"], []).append(name)
        else:
            m = liveness.TAG_LOCK.fullmatch(name)
            if m is not None:
                by_tag.setdefault(m["tag"], [])
    removed = 0
    for tag, files in by_tag.items():
        try:
            claim = liveness.claim_dead(tag)
        except OSError as exc:
            liveness.warn_once(tag, "cannot tell whether the owner of %s-* lives (%s); its files stay", tag, exc)
            continue
        if claim is None:
            continue
        try:
            removed += sum(_unlink_leftover(name) for name in files)
        finally:
            claim.release()
    return removed


def _unlink_leftover(name: str) -> bool:
    """Unlink a dead process's file: only a regular file of this user; the rest is skipped, with
    one warning (another user's file, a directory or a symlink is nobody's arena of ours)."""
    path = os.path.join(SHM_DIR, name)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            liveness.warn_once(name, "%s looks like a warmlink leftover but is not a regular file of this user; "
                                "left alone", path)
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        liveness.warn_once(name, "cannot remove the leftover %s (%s); left alone", path, exc)
        return False


def _unlink_own_shm() -> None:
    """At exit: remove this process's shm files. See Note [Leaked shm files]."""
    tag = liveness.current_tag()
    if tag is None:  # no lock, hence no file, in this process
        return
    prefix = f"{tag}-"  # a forked child inherits _live_shm but must not unlink its parent's files
    with _live_lock:
        names = [name for name in _live_shm if name.startswith(prefix)]
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


def _reap_periodically() -> None:
    """A long-lived process's files outlive no dead peer for long: reap every REAP_INTERVAL_S
    (read each time, so a test can shorten it before the thread starts sleeping)."""
    while True:
        time.sleep(REAP_INTERVAL_S)
        try:
            reap_orphaned_shm()
        except Exception:  # noqa: BLE001 - a reaper thread that dies would stop reaping for good
            log.warning("periodic shm reaping failed", exc_info=True)


def _start() -> str:
    """Once per process, before its first shm file: lock, exit cleanup, reaping. Returns the tag."""
    global _started_pid
    tag = liveness.own_tag()  # the lock's exit handler first: atexit runs ours before it
    if _started_pid == os.getpid():
        return tag
    with _start_lock:
        if _started_pid != os.getpid():
            atexit.register(_unlink_own_shm)
            _started_pid = os.getpid()
            try:
                reap_orphaned_shm()
            except Exception:  # noqa: BLE001 - reaping others' leftovers must not fail our export
                log.warning("shm reaping failed", exc_info=True)
            # A daemon: it holds nothing between sweeps, and exit must not wait for it.
            threading.Thread(target=_reap_periodically, name="warmlink-shm-reaper", daemon=True).start()
    return tag


def _after_fork() -> None:
    global _start_lock
    _start_lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)


def _reserve(fd: int, nbytes: int, path: str) -> None:
    """Give ``fd``'s file ``nbytes`` of real pages. See Note [Reserved shm]."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise PoolError(f"lease_arena: nbytes={nbytes} cannot be reserved at {path}: {exc}") from exc
        space = shm_free_bytes()
        free = f"{space[0]} bytes free of {space[1]}" if space else "free space unknown"
        raise PoolError(
            f"lease_arena: nbytes={nbytes} does not fit in {SHM_DIR} ({free}; {exc.strerror}); expected nbytes <= the "
            f"free space (give the process more shared memory, e.g. docker run --shm-size, or free {SHM_DIR})"
        ) from exc


def _create_shm(nbytes: int):
    try:
        tag = _start()
    except PoolError as exc:
        raise PoolError(f"lease_arena: cannot create {nbytes} bytes of shared memory: {exc}") from exc
    name = f"{tag}-{next(_counter)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PoolError(f"lease_arena: cannot create {nbytes} bytes of shared memory at {path}: {exc}") from exc
    try:
        _reserve(fd, nbytes, path)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException as exc:
        os.unlink(path)
        if isinstance(exc, OSError):
            raise PoolError(f"lease_arena: cannot create {nbytes} bytes of shared memory at {path}: {exc}") from exc
        raise
    finally:
        os.close(fd)
    tensor = mapped_tensor(mm)
    arena = Arena("shm", -1, nbytes, tensor, tensor.data_ptr(), name, _ShmOwner(name, mm))
    with _live_lock:
        _live_shm[name] = arena
    return arena


def _destroy_shm(arena: Arena) -> None:
    owner: _ShmOwner = arena._owner
    with _live_lock:
        _live_shm.pop(owner.name, None)
    try:
        os.unlink(os.path.join(SHM_DIR, owner.name))
    except FileNotFoundError:
        pass
    arena.tensor = None
    mm, owner.mm = owner.mm, None
    try:
        if mm is not None:
            mm.close()
    except BufferError:
        # A view of the arena is still alive somewhere; the mapping goes when it does (Note
        # [Views keep a mapping]).
        pass


# -- cuda -----------------------------------------------------------------------------------------
def _create_cuda(device: int, nbytes: int) -> Arena:
    from warmlink import _cuda

    ptr = _cuda.malloc(nbytes, device)
    tensor = _cuda.tensor_from_ptr(ptr, nbytes, device)
    return Arena("cuda", device, nbytes, tensor, ptr, None, None)


def _destroy_cuda(arena: Arena) -> None:
    from warmlink import _cuda

    arena.tensor = None
    _cuda.free(arena.ptr, arena.device)


# -- the pool -------------------------------------------------------------------------------------
def _create(key: tuple[str, int, int]) -> Arena:
    kind, device, nbytes = key
    if kind == "shm":
        return _create_shm(nbytes)
    if kind == "cuda":
        return _create_cuda(device, nbytes)
    raise ConfigError(f"lease_arena: kind={kind!r} is unknown; expected 'shm' or 'cuda'")


def _reset(arena: Arena) -> bool:
    arena.generation += 1
    if arena.tensor is None:
        return False
    # An shm file unlinked behind our back would be exported under a name peers cannot open.
    return arena.kind != "shm" or os.path.exists(os.path.join(SHM_DIR, arena.name))


def _destroy(arena: Arena) -> None:
    (_destroy_shm if arena.kind == "shm" else _destroy_cuda)(arena)


# Arenas are large: at most 8 idle of one size and 16 in all (the oldest idle one goes first).
_arenas: FreeList[tuple[str, int, int], Arena] = FreeList("arena", _create, _reset, _destroy, max_idle_per_key=8,
                                                          max_idle_total=16)


def lease_arena(kind: str, nbytes: int, device: int = -1) -> Lease[Arena]:
    """Lease an arena of at least ``nbytes`` (rounded up to 2 MiB).

    Args:
        kind: ``"shm"`` (host shared memory, ``device=-1``) or ``"cuda"``.
        nbytes: bytes needed, > 0.
        device: CUDA device index for ``"cuda"``; -1 for ``"shm"``.

    Returns:
        A ``Lease`` whose ``resource`` is the ``Arena``; contents are undefined (not zeroed).

    Raises:
        PoolError: the memory is not there: /dev/shm cannot hold ``nbytes`` (the message names the
            bytes wanted and free; see Note [Reserved shm]), or the device is out of memory.

    Warm path? Reuses an idle arena of the same rounded size; creates one only on a miss.
    """
    if nbytes <= 0:
        raise ConfigError(f"lease_arena: nbytes={nbytes!r} must be > 0")
    if kind == "shm" and device != -1:
        raise ConfigError(f"lease_arena: device={device} for kind='shm'; expected -1")
    if kind == "cuda" and device < 0:
        raise ConfigError(f"lease_arena: device={device} for kind='cuda'; expected a CUDA device index >= 0")
    return _arenas.lease((kind, device, round_up(nbytes)))


def clear_idle() -> None:
    """Destroy idle arenas (tests and teardown)."""
    _arenas.clear()


def find_shm_arena(ptr: int, nbytes: int) -> Arena | None:
    """The live shm arena (leased or idle) that holds ``[ptr, ptr + nbytes)``, if any."""
    with _live_lock:
        for arena in _live_shm.values():
            if arena.tensor is not None and arena.ptr <= ptr and ptr + nbytes <= arena.ptr + arena.nbytes:
                return arena
    return None


def num_live_shm() -> int:
    """How many shm arenas this process holds (leased or idle)."""
    with _live_lock:
        return len(_live_shm)
