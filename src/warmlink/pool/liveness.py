"""Process liveness that holds across PID namespaces and containers: a lock held for life.

# Note [Process locks]
Every warmlink process that shares memory or reads published versions holds an exclusive
``flock`` on a file of its own, ``{SHM_DIR}/wl-<pid>-<hex8>.lock``, from first use until it
exits. The kernel drops the lock when the process dies, however it dies and in whatever PID
namespace or container it ran, so "the lock is held" is the one liveness test that does not
depend on pids or hostnames, which mean nothing across namespaces (``--ipc=host`` containers
share /dev/shm but not their pid tables).

* The tag ``wl-<pid>-<hex8>`` names the process; its arenas are ``<tag>-<n>`` (``pool.arenas``),
  so a reaper finds a file's owner from its name alone.
* A peer is alive iff its lock is held: a checker takes a non-blocking shared lock on the file
  and drops it at once; getting it means the owner is gone. A lock file that is missing is gone
  too (its owner removes it last at exit, a reaper removes it while holding its lock).
* The lock appears already held: the creator takes it right after ``O_EXCL`` creation and then
  checks that the path still names its inode, so a reaper that locked and removed the new file
  in that instant makes the creator start over with another name, never run unlocked.
* What a peer publishes is a *token*, ``<shm key>/<tag>.lock``. The shm key is the host's boot id
  and the device of the lock directory: equal keys mean the same tmpfs, where the lock is the
  peer's. A token with another key belongs to another host or another /dev/shm: it cannot be
  checked here and reads as unknown (callers keep their timeouts). A token is peer metadata: its
  name must match the pattern exactly, be named for the peer's pid, and open (``O_NOFOLLOW``)
  as a regular file owned by this user; anything else reads as unknown, never as dead.
* A forked child holds its parent's lock through the inherited descriptor: it closes its copy
  (the parent keeps the lock) and makes its own lock on first use.
* At exit the lock file is removed after the process's arenas (``atexit`` runs handlers last in,
  first out, and the arenas register theirs after the lock exists).

Removing a live process's lock file by hand makes that process look dead to its peers.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import threading

from warmlink.errors import PoolError

__all__ = ["SHM_DIR", "own_tag", "current_tag", "token", "token_alive", "open_token", "claim_dead", "DeadClaim",
           "pid_alive", "warn_once", "local_key"]

log = logging.getLogger("warmlink.pool")

SHM_DIR = "/dev/shm"
# The names a process's tag owns, written once: every layer that checks a name from a peer or
# from /dev/shm matches these.
TAG = re.compile(r"wl-(?P<pid>[0-9]{1,10})-[0-9a-f]{8}")
TAGGED_NAME = re.compile(rf"(?P<tag>{TAG.pattern})-[0-9]{{1,10}}")  # an shm arena (pool.arenas)
TAG_LOCK = re.compile(rf"(?P<tag>{TAG.pattern})\.lock")  # a process's lock file
TOKEN = re.compile(rf"(?P<key>[0-9a-f]{{32}}-[0-9a-f]{{1,16}})/{TAG_LOCK.pattern}")  # what ``token`` returns
_OPEN_CHECK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC



class _ProcessLock:
    """This process's lock file, held (``fd``) from creation until exit."""

    __slots__ = ("pid", "tag", "fd", "path", "key")

    def __init__(self, pid: int, tag: str, fd: int, path: str, key: str | None) -> None:
        self.pid, self.tag, self.fd, self.path, self.key = pid, tag, fd, path, key

    def __repr__(self) -> str:
        return f"_ProcessLock({self.tag}, fd={self.fd})"


_lock = threading.Lock()
_state: _ProcessLock | None = None
_atexit_registered = False
_warned: set[str] = set()


def warn_once(name: str, msg: str, *args) -> None:
    """Log ``msg`` as a warning the first time ``name`` is the subject (periodic reaping repeats)."""
    if name not in _warned:
        _warned.add(name)
        log.warning(msg, *args)


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            raw = f.read().strip().replace("-", "")
    except OSError:
        return None
    return raw if re.fullmatch(r"[0-9a-f]{32}", raw) else None


def _shm_key(st_dev: int) -> str | None:
    boot = _boot_id()
    return None if boot is None else f"{boot}-{st_dev:x}"


def _create() -> _ProcessLock:
    """Make and lock this process's lock file. See Note [Process locks]."""
    pid = os.getpid()
    last: OSError | None = None
    for _ in range(16):
        tag = f"wl-{pid}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, f"{tag}.lock")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError as exc:
            last = exc
            continue
        except OSError as exc:
            raise PoolError(f"process lock: cannot create {path}: {exc}; expected a writable {SHM_DIR} "
                            "(every warmlink process keeps a lock file there while it lives)") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mine = os.fstat(fd)
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return _ProcessLock(pid, tag, fd, path, _shm_key(mine.st_dev))
        except OSError as exc:  # a reaper got here first (locked it, or removed it): another name
            last = exc
        os.close(fd)
    raise PoolError(f"process lock: no lock file could be made in {SHM_DIR} after 16 names: {last}")


def _own() -> _ProcessLock:
    global _state, _atexit_registered
    state = _state
    if state is not None and state.pid == os.getpid():
        return state
    with _lock:
        if _state is None or _state.pid != os.getpid():
            _state = _create()
            if not _atexit_registered:
                _atexit_registered = True
                atexit.register(_release)
        return _state


def own_tag() -> str:
    """This process's tag ``wl-<pid>-<hex8>``, its lock taken on first call. See Note [Process locks].

    Raises:
        PoolError: no lock file can be made in ``SHM_DIR``.
    """
    return _own().tag


def current_tag() -> str | None:
    """This process's tag if it holds its lock already, else None (takes nothing)."""
    state = _state
    return state.tag if state is not None and state.pid == os.getpid() else None


def token() -> str | None:
    """What peers need to check this process's liveness (``<shm key>/<tag>.lock``), or None when
    this process cannot hold a lock or name its tmpfs (no writable ``SHM_DIR``, no boot id)."""
    try:
        state = _own()
    except PoolError as exc:
        warn_once("<token>", "no process lock: peers fall back to host and pid to tell whether this process lives (%s)", exc)
        return None
    return None if state.key is None else f"{state.key}/{state.tag}.lock"


def local_key() -> str | None:
    """The key of this host's tmpfs (boot id and device) that tokens of peers sharing it carry."""
    return _local_key()


def _local_key() -> str | None:
    state = _state
    if state is not None and state.pid == os.getpid():
        return state.key
    try:
        return _shm_key(os.stat(SHM_DIR).st_dev)
    except OSError:
        return None


def _open_lock(tag: str) -> tuple[int | None, str]:
    """Open ``tag``'s lock file for checking: ``(fd, "ok")``, ``(None, "missing")`` or ``(None,
    "unknown")`` (a symlink, not a regular file, another user's, unreadable)."""
    path = os.path.join(SHM_DIR, f"{tag}.lock")
    try:
        fd = os.open(path, _OPEN_CHECK)
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        warn_once(path, "cannot check the process lock %s (%s); its owner is taken to be alive", path, exc)
        return None, "unknown"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        warn_once(path, "%s is not a regular file of this user; its owner is taken to be alive", path)
        return None, "unknown"
    return fd, "ok"


def token_alive(tok: str, pid: int | None = None) -> bool | None:
    """Whether the process that published ``tok`` (see ``token``) lives.

    Args:
        tok: a token read from the store (peer metadata: validated here).
        pid: the pid the peer announced beside it; a token not named for it is not trusted.

    Returns:
        True (its lock is held), False (free or removed: the process is gone) or None (another
        host or tmpfs, or a token that does not check out: callers keep their timeouts).
    """
    fd, how = _open_token(tok, pid)
    if fd is None:
        return False if how == "missing" else None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops the shared lock taken from a dead owner
    return False


def open_token(tok: str, pid: int | None = None) -> int | None:
    """A descriptor of the lock file ``tok`` names, for asking again and again whether its owner
    lives (``flock(LOCK_SH | LOCK_NB)``: refused while the owner holds its lock); the caller
    closes it. None when the token cannot be checked here (another host or tmpfs, malformed, not
    named for ``pid``, not a regular file of this user) or the file is gone already."""
    return _open_token(tok, pid)[0]


def _open_token(tok: str, pid: int | None) -> tuple[int | None, str]:
    """``_open_lock`` of the lock ``tok`` names, once it checks out: ``(None, "unknown")`` for a
    malformed token, one not named for ``pid``, or one of another host or tmpfs."""
    m = TOKEN.fullmatch(tok) if isinstance(tok, str) else None
    if m is None or (pid is not None and int(m["pid"]) != pid):
        return None, "unknown"
    key = _local_key()
    if key is None or m["key"] != key:
        return None, "unknown"
    return _open_lock(m["tag"])


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process in this PID namespace (zombies are dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except PermissionError:
        return True


class DeadClaim:
    """The lock of a dead process, held by a reaper while it removes that process's files.

    ``release`` removes the lock file (when it is still the inode locked) and closes it.
    """

    __slots__ = ("tag", "_fd", "_path")

    def __init__(self, tag: str, fd: int | None) -> None:
        self.tag = tag
        self._fd = fd
        self._path = os.path.join(SHM_DIR, f"{tag}.lock")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            mine, now = os.fstat(fd), os.stat(self._path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(self._path)  # unlinked while locked: a creator racing us starts over
        except OSError:
            pass
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"DeadClaim({self.tag}, held={self._fd is not None})"


def claim_dead(tag: str) -> DeadClaim | None:
    """A ``DeadClaim`` on ``tag`` when its process is gone, else None (alive, or not ours to judge).

    A tag whose lock file is missing is judged by its pid in this namespace: such files come from
    a process that could not keep its lock (or an older warmlink), and a live pid keeps them.
    """
    own = _state
    if own is not None and own.pid == os.getpid() and own.tag == tag:
        return None
    fd, how = _open_lock(tag)
    if fd is None:
        m = TAG.fullmatch(tag)
        return DeadClaim(tag, None) if how == "missing" and m is not None and not pid_alive(int(m["pid"])) else None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            warn_once(tag, "cannot lock %s.lock (%s); its owner is taken to be alive", tag, exc)
        return None
    return DeadClaim(tag, fd)


def _release() -> None:
    """At exit: drop this process's lock file (the arenas' handler ran first). Idempotent."""
    global _state
    with _lock:
        state = _state
        if state is None or state.pid != os.getpid():
            return
        _state = None
    try:
        os.unlink(state.path)
    except OSError:
        pass
    os.close(state.fd)


def _after_fork() -> None:
    """In a forked child: close the inherited descriptor (the parent keeps its lock) and forget it."""
    global _state, _lock
    _lock = threading.Lock()
    state, _state = _state, None
    if state is not None:
        try:
            os.close(state.fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork)
