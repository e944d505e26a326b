"""The version protocol between processes of one host, through a board in shared memory.

# Note [Version board]
Every publisher rank keeps a *board*: a small shm file holding its generation, its version and
its state (published, updating, closed), announced in its manifest. A receiver on the same host
(the same /dev/shm, which the publisher's liveness token names) enters and leaves a version
through the board instead of the store, so a warm cycle pays no store round trip to sync:

* A receiver *enters*: ``flock(LOCK_SH | LOCK_NB)`` on its own descriptor of the board, then reads
  the board. Published, of the generation it planned against (and the version asked for, if
  any), by a publisher whose process lock is held: it is in, and keeps the shared lock while its
  bytes move. Updating (or the lock refused): it unlocks and waits on the board. Closed, another
  generation or a dead publisher: it unlocks and reads the store, which says what comes next.
* A receiver *leaves*: ``flock(LOCK_UN)``.
* A publisher *begins an update*: it writes ``updating`` (new receivers back off), then takes
  ``flock(LOCK_EX | LOCK_NB)``, retried until its timeout: it gets it once every shared lock is
  gone. Only then may the trainer write the tensors.
* It *publishes*: it writes the new version and ``published`` while still holding the lock,
  then drops it. It *withdraws* (close) the same way, writing ``closed``; a publisher re-created
  in the same process over the same memory takes the board back (pooling on), so that its
  manifest, and hence its generation, stay what receivers already planned against.

The exclusion is the kernel's: the publisher writes tensors only while it holds the exclusive
lock, a receiver reads them only while it holds a shared one, so no value in the store or the
board can make a publisher overwrite bytes a local receiver is pulling. The board's words only
say which version is published (written under the exclusive lock, read under a shared one: the
lock hand-over orders them) and let new receivers stay out while the publisher waits, so that it
is not starved; a receiver's unlocked look at them is a hint that is checked again under the lock.
A receiver that dies mid-pull drops its lock with its descriptors: the next update proceeds at
once, no reaping needed. One that stalls holding it makes ``begin_update`` time out. Each
receiver opens the board itself: flock locks belong to an open file, so two receivers of one
process never release each other's.

Receivers on other hosts (NIXL), or whose board cannot be opened, keep the store's reader counts
(Note [Version protocol]); the publisher waits for both.

# Note [Reader line]
Exclusion alone lets a busy trainer starve its receivers: it drains them, writes, publishes and
at once says ``updating`` again, and a receiver that was backing off while it wrote finds the
next update begun whenever it looks (200 receivers on a loaded host timed out by the hundreds).
So a receiver that finds a publisher updating *stands in line* until it is in: on the board a
shared OFD lock on a byte past the words (``_LINE_AT``; OFD locks belong to an open file, as flock
locks do, and are independent of them), in the store a count ``pub/{rank}/line/{slot}`` (Note
[Reader slots]). Before it says ``updating``, a publisher waits while anyone stands in line, for
at most ``line_wait_s`` (``LINE_WAIT_S`` by default): a receiver in line when a version is published enters that version
(one backoff step after it looks), so its wait is bounded by one update of the trainer plus its
own backoff step, not by luck. The line never lets anyone read while the trainer writes: it only
delays ``updating``. A receiver that dies drops its lock with its descriptor (its store count
goes with its slot's death); one stalled in line, or a forged count, delays each update by at
most ``line_wait_s``.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct

from warmlink._backoff import wait_until
from warmlink.errors import MetadataError, PoolError
from warmlink.pool.core import PerOwner

__all__ = ["LINE_WAIT_S", "PublisherBoard", "ReaderBoard", "take_parked", "park", "release_parked_boards", "BOARD_NBYTES", "PUBLISHED", "UPDATING", "CLOSED", "STATE_NAMES"]

BOARD_NBYTES = 64
_MAGIC = 0x31304452414F4257  # "WBOARD01", little-endian
_WORDS = struct.Struct("<4q")  # magic, generation, version, state
_STATE = struct.Struct("<q")
_STATE_AT = 24
LINE_WAIT_S = 1.0  # the longest a publisher holds a version open for receivers in line (Note [Reader line])
_LINE_AT = BOARD_NBYTES  # the byte locked by receivers in line (Note [Reader line]); past the words
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD)


def _line_lock(fd: int, cmd: int, kind: int) -> int:
    """An OFD lock operation on the line byte; returns the lock type the kernel reports."""
    return _FLOCK.unpack(fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, _LINE_AT, 1, 0)))[0]
PUBLISHED, UPDATING, CLOSED = 0, 1, 2
STATE_NAMES = {PUBLISHED: "published", UPDATING: "updating", CLOSED: "closed"}


class PublisherBoard:
    """A publisher rank's board: a shm arena of its own, written only by it.

    Args:
        generation, version: what it announces first (``published``).

    ``desc`` goes into the manifest (``{"name", "token"}``: the arena's file and the
    publisher's liveness token, which says which /dev/shm the file is in).
    """

    __slots__ = ("_lease", "_fd", "_words", "desc", "_locked")

    def __init__(self) -> None:
        from warmlink.pool import liveness
        from warmlink.pool.arenas import SHM_DIR, lease_arena

        self._lease = lease_arena("shm", BOARD_NBYTES)
        self._fd = None
        self._locked = False
        try:
            arena = self._lease.resource
            self._fd = os.open(os.path.join(SHM_DIR, arena.name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            self._words = memoryview(arena.tensor.numpy()).cast("B")[:BOARD_NBYTES]
            token = liveness.token()
            if token is None:
                raise PoolError("no process lock: receivers could not tell which /dev/shm the board is in")
            self.desc = {"name": arena.name, "token": token}
            self._write(0, 0, CLOSED)  # a pooled arena may hold an old board's words
        except BaseException:
            self.close()
            raise

    def _write(self, generation: int, version: int, state: int) -> None:
        self._words[:_WORDS.size] = _WORDS.pack(_MAGIC, generation, version, state)

    def begin(self, version: int, timeout_s: float, *, state: int = UPDATING) -> None:
        """Say ``updating`` (or ``closed``) and wait until no local receiver reads: the exclusive
        lock, held until ``publish``. Raises TransferTimeout naming the version."""
        # Only the state word changes while receivers may be reading it (as a hint): one store.
        self._words[_STATE_AT:_STATE_AT + 8] = _STATE.pack(state)
        if self._locked:
            return

        def excl() -> bool:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        wait_until(excl, timeout_s=timeout_s, what=lambda: (
            f"Publisher.begin_update: version {version} still has a reader on this host after {timeout_s:.3f} s; "
            "a receiver stalled mid-pull (one that died would have released its lock)"))
        self._locked = True

    def line_waiting(self) -> bool:
        """Whether a receiver on this host stands in line for the next version (Note [Reader line])."""
        return _line_lock(self._fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK) != fcntl.F_UNLCK

    def publish(self, generation: int, version: int, timeout_s: float) -> None:
        """Announce ``version`` of ``generation`` and let local receivers in (the exclusive lock
        is taken first when not held: a board taken back from a closed publisher)."""
        if not self._locked:
            self.begin(version, timeout_s, state=CLOSED)
        self._write(generation, version, PUBLISHED)
        self._unlock()

    def withdraw(self, version: int, timeout_s: float) -> None:
        """Say ``closed`` once no local receiver reads ``version``; then the board may be pooled."""
        self.begin(version, timeout_s, state=CLOSED)
        self._unlock()

    def _unlock(self) -> None:
        if self._locked:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._locked = False

    def close(self) -> None:
        """Give the arena back (the caller withdrew first)."""
        if self._fd is not None:
            os.close(self._fd)  # also drops the exclusive lock
            self._fd = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def __repr__(self) -> str:
        return f"PublisherBoard({self.desc.get('name') if hasattr(self, 'desc') else None}, locked={self._locked})"


# (store, rank) -> the board of a publisher closed in this process, for its successor: the same
# board keeps the manifest, hence the generation, of a publisher re-created over the same memory.
# A pool kind, so with pooling off nothing is parked (a board put there is closed at once). Its
# arena is counted as an arena already: the kind stays out of stats().
_parked = PerOwner("parked_board", destroy=PublisherBoard.close, counted=False)


def take_parked(store, rank: int) -> PublisherBoard | None:
    """The board a closed publisher of ``rank`` parked under ``store``, taken out; or None
    (none parked, or pooling off)."""
    return _parked.take(store, rank)


def park(store, rank: int, board: PublisherBoard) -> None:
    """Keep ``board`` (withdrawn: ``closed``, unlocked) for the next publisher of ``rank``,
    closing the one parked before; with pooling off, close it."""
    _parked.put(store, rank, board)


def release_parked_boards() -> None:
    """Give every parked board's arena back (``refit._parked.release_parked``)."""
    _parked.clear()


class ReaderBoard:
    """A receiver's own descriptor of one publisher's board, opened only when that board is on
    this host's /dev/shm and checks out (``open`` returns None otherwise: the store protocol)."""

    __slots__ = ("_fd", "_map", "_in", "_in_line", "name", "_owner_fd")

    def __init__(self, fd: int, mapping: mmap.mmap, name: str, owner_fd: int | None) -> None:
        self._fd, self._map, self._in, self._in_line, self.name = fd, mapping, False, False, name
        self._owner_fd = owner_fd  # the publisher process's lock file (Note [Process locks])

    @classmethod
    def open(cls, desc: dict | None, peer_pid: int, peer_name: str) -> "ReaderBoard | None":
        """The board of ``desc`` (from a validated manifest), or None when it is not on this host.

        Raises:
            MetadataError: the board is on this host but is not what the manifest says (not a
                regular file of this user, named for another process, too small, no board).
        """
        from warmlink.pool import liveness

        if desc is None:
            return None
        key = liveness.local_key()
        token = desc.get("token") or ""
        if key is None or not token.startswith(key + "/"):
            return None  # another host or /dev/shm: this receiver uses the store's counts
        name = desc.get("name")
        m = liveness.TAGGED_NAME.fullmatch(name) if isinstance(name, str) else None
        where = f"publisher manifest from peer={peer_name!r}: board.name={name!r}"
        if m is None or int(m["pid"]) != peer_pid:
            raise MetadataError(f"{where} invalid; expected an arena of the publisher's process (pid {peer_pid})")
        try:
            fd = os.open(os.path.join(liveness.SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # the publisher is gone: its state in the store says what happens next
        except OSError as exc:
            raise MetadataError(f"{where} cannot be opened ({errno.errorcode.get(exc.errno, exc.errno)}); expected "
                                "a regular file of this user") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < BOARD_NBYTES:
                raise MetadataError(f"{where} is not a regular file of this user of at least {BOARD_NBYTES} bytes")
            mapping = mmap.mmap(fd, BOARD_NBYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        board = cls(fd, mapping, name, liveness.open_token(token, peer_pid))
        if board.read()[0] != _MAGIC:
            board.close()
            raise MetadataError(f"{where} holds no warmlink board; expected the publisher's")
        return board

    def read(self) -> tuple[int, int, int, int]:
        """``(magic, generation, version, state)`` as the board says now."""
        return _WORDS.unpack_from(self._map, 0)

    def owner_alive(self) -> bool:
        """Whether the publisher's process lives: its lock is held (a free lock: it died)."""
        if self._owner_fd is None:
            return True  # no lock to ask: the store's state and the pull's liveness checks decide
        try:
            fcntl.flock(self._owner_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._owner_fd, fcntl.LOCK_UN)
        return False

    def enter(self, generation: int, version: int | None) -> tuple[bool, int, int]:
        """Try to enter: ``(entered, board version, board state)``. Entered means the shared lock
        is held and the board says ``published`` of ``generation`` (and ``version``, if given) by a
        living publisher. ``CLOSED`` means the publisher moved on (closed, restarted or dead): the
        store says what comes next. ``UPDATING``: wait on the board."""
        _, gen, ver, state = self.read()  # a hint, checked again under the lock
        if gen != generation or state == CLOSED:
            return False, ver, CLOSED
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False, ver, UPDATING  # the publisher holds it
        _, gen, ver, state = self.read()
        if gen != generation:
            state = CLOSED
        elif state == PUBLISHED and (version is None or ver == version):
            if self.owner_alive():  # a dead publisher's board stays "published"
                self._in = True
                return True, ver, state
            state = CLOSED
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False, ver, state

    def leave(self) -> None:
        if self._in:
            self._in = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def join_line(self) -> None:
        """Stand in line for the next published version (Note [Reader line]); idempotent."""
        if not self._in_line:
            _line_lock(self._fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK)
            self._in_line = True

    def leave_line(self) -> None:
        if self._in_line:
            self._in_line = False
            _line_lock(self._fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK)

    def close(self) -> None:
        if self._fd is not None:
            self._map.close()
            os.close(self._fd)  # also drops a shared lock still held, and its place in line
            self._fd = None
            self._in = self._in_line = False
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    def __repr__(self) -> str:
        return f"ReaderBoard({self.name}, inside={self._in})"
