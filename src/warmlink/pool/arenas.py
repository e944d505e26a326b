"""Transfer arenas: large allocations that can be shared with other processes.

Two kinds:

* ``"shm"``: host memory in a POSIX shared-memory file (``/dev/shm/wl-<pid>-...``), mapped with
  ``mmap``. Peers open it by name. The CPU path and the one CI tests.
* ``"cuda"``: device memory from plain ``cudaMalloc`` (never expandable segments nor
  ``cudaMallocAsync``: only plain allocations export reliably as CUDA IPC handles and register
  with RDMA NICs).

Arenas are leased from the pool by ``(kind, device, rounded nbytes)`` and come back with their
``generation`` bumped, so that anything keyed on an arena's old contents is visibly stale.

# Note [Leaked shm files]
A process that dies without closing its arenas leaves files in /dev/shm. Their names carry the
creating pid; ``reap_orphaned_shm()`` removes those whose pid is gone. It runs once per process
before the first shm arena is created. A process that exits normally unlinks its own files at
exit (idle pooled arenas are never destroyed otherwise); peers that mapped them keep their
mappings, and a later ``open`` fails with PeerLostError, as for any peer that left.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import re
import secrets
import threading

from warmlink.pool.core import FreeList, Lease
from warmlink.errors import ConfigError, PoolError

__all__ = ["Arena", "lease_arena", "round_up", "ARENA_ALIGN_BYTES", "SHM_DIR", "reap_orphaned_shm", "shm_prefix"]

ARENA_ALIGN_BYTES = 2 << 20  # 2 MiB: the granularity of CUDA IPC and of huge pages
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^wl-(\d+)-[0-9a-f]+-\d+$")
_counter = itertools.count()
_reaped = threading.Event()
_live_lock = threading.Lock()
_live_shm: dict[str, "Arena"] = {}


def round_up(nbytes: int, align: int = ARENA_ALIGN_BYTES) -> int:
    return max(align, (nbytes + align - 1) // align * align)


def shm_prefix() -> str:
    return f"wl-{os.getpid()}-"


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


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except PermissionError:
        return True


def reap_orphaned_shm() -> int:
    """Remove /dev/shm files left by dead warmlink processes. See Note [Leaked shm files]."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return 0
    for name in names:
        m = _SHM_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _unlink_own_shm() -> None:
    """At exit: remove this process's shm files. See Note [Leaked shm files]."""
    prefix = shm_prefix()  # a forked child inherits _live_shm but must not unlink its parent's files
    with _live_lock:
        names = [name for name in _live_shm if name.startswith(prefix)]
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


def _create_shm(nbytes: int):
    import torch

    if not _reaped.is_set():
        _reaped.set()
        reap_orphaned_shm()
        atexit.register(_unlink_own_shm)
    name = f"{shm_prefix()}{secrets.token_hex(4)}-{next(_counter)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.unlink(path)
        raise PoolError(f"lease_arena: cannot create {nbytes} bytes of shared memory at {path}: {exc}") from exc
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mm, dtype=torch.uint8)
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
    try:
        owner.mm.close()
    except BufferError:
        # A view of the arena is still alive somewhere; the mapping goes when it does.
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
