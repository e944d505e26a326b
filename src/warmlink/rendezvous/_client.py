"""One TCPStore client connection whose every request ends by its limit, for ``rendezvous.Store``
(Note [Store deadlines] there). This module knows nothing of keys or warmlink errors.

# Note [Bounded requests]
TCPStore's client socket has no timeout (torch 2.13), so a request to a stopped server blocks
until it answers.
- A request: ``Client.call`` sets the socket's ``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` to the call's
  limit, so a blocked send or receive fails when it passes. No thread is involved; the two system
  calls are made only when the limit changes (a socket timeout up to 1 % + 5 ms longer is kept),
  so a warm cycle passing one limit pays none. A request that sends more than ``WATCHDOG_BYTES``
  also gets a watchdog thread: a send that made progress returns after a whole socket timeout and
  TCPStore sends the rest, so only the watchdog, which shuts the socket down at the limit, bounds
  the request.
- A new connection has no socket to set options on until TCPStore's constructor returns, and the
  constructor's handshake blocks on a stopped server: a watchdog thread shuts the new socket down
  at the limit, which makes the constructor fail at once.
- The socket of a connection is found among this process's file descriptors: the one socket new
  since the constructor started that is connected to the store's port (connections are opened one
  at a time). The client keeps a duplicate of it; its owner is still TCPStore. A server store uses
  the connection its TCPStore server opens to itself: a second one would cost a connection more.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import stat
import struct
import threading
import time
from typing import Any, Callable

__all__ = ["Client", "Stalled", "connect", "serve"]

# A request that sends more than this also gets a watchdog: a send blocked on a full socket buffer
# returns a partial count after a whole SO_SNDTIMEO, and TCPStore then sends the rest, so the
# socket timeout alone bounds each send, not the request.
WATCHDOG_BYTES = 1 << 20
_SHOOT_EVERY_S = 0.02
# One connection opened at a time in this process: its socket is told apart from the others as
# the one new socket connected to the store's port.
_connect_lock = threading.Lock()


class Stalled(Exception):
    """A request or a connection attempt ran past its limit; that connection is unusable."""


def _sockets() -> dict[int, int]:
    """fd -> inode of every socket this process holds."""
    root = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    out = {}
    for name in os.listdir(root):
        try:
            fd = int(name)
            st = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[fd] = st.st_ino
    return out


def _connected_to(fd: int, port: int) -> bool:
    """True when ``fd`` is an internet socket connected to ``port`` from another port (the client
    end, not a server's accepted end)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getpeername()[1] == port
                and sock.getsockname()[1] != port)
    except OSError:
        return False
    finally:
        sock.close()


def _shut(fd: int) -> None:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


class _Watchdog:
    """From ``timeout_s`` on, shuts down every socket ``targets()`` lists, again every 20 ms until
    ``stop()``: a TCPStore request or constructor blocked on one of them fails at once (TCPStore
    retries a failed connection attempt while its own timeout lasts, on a new socket)."""

    def __init__(self, timeout_s: float, targets: Callable[[], list[int]]) -> None:
        self.fired = False
        self._targets = targets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), name="warmlink-store-watchdog",
                                        daemon=True)
        self._thread.start()

    def _run(self, timeout_s: float) -> None:
        if self._stop.wait(min(timeout_s, threading.TIMEOUT_MAX)):
            return
        self.fired = True
        while True:
            for fd in self._targets():
                _shut(fd)
            if self._stop.wait(_SHOOT_EVERY_S):
                return

    def stop(self) -> bool:
        """Stop watching; True when it fired (the socket may be shut down, whatever the call returned)."""
        self._stop.set()
        self._thread.join()
        return self.fired


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class Client:
    """A TCPStore client, its ``PrefixStore`` and a duplicate of its socket, through which each
    request's limit is set. Not thread-safe: ``Store`` runs one request at a time.

    ``broken`` turns True when a request stalled or a watchdog shut the socket: never use it again.
    """

    __slots__ = ("tcp", "store", "broken", "_sock", "_timeout_s")

    def __init__(self, tcp: Any, prefix: str, sock: socket.socket) -> None:
        import torch.distributed as dist

        self.tcp = tcp
        self.store = dist.PrefixStore(prefix, tcp)
        self.broken = False
        self._sock = sock
        self._timeout_s = -1.0

    def call(self, method: str, args: tuple, timeout_s: float, nbytes: int = 0) -> Any:
        """``PrefixStore.<method>(*args)`` within ``timeout_s`` seconds (a stall ends it a little
        later at most: 1 % + 5 ms). ``nbytes``: what it sends, for the watchdog.

        Raises:
            Stalled: it ran out of time; this client is broken.
            Exception: any other failure of TCPStore, as raised.
        """
        current = self._timeout_s
        # A limit a little under the socket's keeps it: a warm cycle passes one limit per call, so
        # the system calls happen when the limit changes, not on every request.
        if not timeout_s <= current <= timeout_s * 1.01 + 0.005:
            tv = _timeval(timeout_s)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._timeout_s = timeout_s
        fn = getattr(self.store, method)
        start = time.monotonic()
        dog = _Watchdog(timeout_s, lambda: [self._sock.fileno()]) if nbytes > WATCHDOG_BYTES else None
        try:
            return fn(*args)
        except Exception as exc:
            fired = dog is not None and dog.stop()
            if fired or "Socket Timeout" in str(exc) or time.monotonic() - start >= timeout_s:
                self.broken = True
                raise Stalled(f"no answer within {timeout_s:.3g} s") from None
            raise
        finally:
            if dog is not None and dog.stop():
                self.broken = True

    def close(self) -> None:
        """Close the socket's duplicate, which would keep the connection open after TCPStore's
        own is gone; the connection closes when the last reference to ``tcp`` goes."""
        self.broken = True
        self._sock.close()


def _opened(before: dict[int, int], port: int) -> list[int]:
    """The sockets new since ``before`` (``_sockets()``) that are connected to ``port``."""
    return [fd for fd, ino in _sockets().items() if before.get(fd) != ino and _connected_to(fd, port)]


def _sole(tcp: Any, prefix: str, before: dict[int, int], port: int) -> Client | None:
    """A Client of ``tcp`` when exactly one socket new since ``before`` connects to ``port``."""
    fds = _opened(before, port)
    return Client(tcp, prefix, socket.socket(fileno=os.dup(fds[0]))) if len(fds) == 1 else None


def _listener(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (0: a free port): TCPStore's own server would
    listen on every interface (Note [TCPStore quirks] in rendezvous.store)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's: a restart may reuse the port
        sock.bind(addr)
        sock.listen(128)  # TCPStore's server listens again with its own backlog
    except BaseException:
        sock.close()
        raise
    return sock


def serve(host: str, port: int, prefix: str, timeout_s: float, world_size: int | None) -> Client:
    """Start a TCPStore server listening on ``host:port`` only (0: any free port) and return the
    client connection its constructor opens to it (``client.tcp`` is the server: dropping it stops
    serving and closes the listening socket).

    Raises:
        Exception: the socket's or TCPStore's failure to start, as raised; Stalled: its connection
            could not be told apart from another opened at the same moment.
    """
    import torch.distributed as dist

    with _connect_lock:
        sock = _listener(host, port)
        port, inode = sock.getsockname()[1], os.fstat(sock.fileno()).st_ino
        before = _sockets()
        fd = sock.detach()  # TCPStore's from here: it closes the socket when the server stops
        try:
            tcp = dist.TCPStore(host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            if _sockets().get(fd) == inode:  # still ours: TCPStore failed before it took it
                os.close(fd)
            raise
        client = _sole(tcp, prefix, before, int(tcp.port))
    if client is None:
        raise Stalled("its own connection could not be told apart from another opened at the same moment")
    return client


def connect(host: str, port: int, prefix: str, timeout_s: float) -> Client:
    """A new client connection to the TCPStore server at ``host:port``, its handshake within ``timeout_s``.

    Raises:
        Stalled: no answer in time (the port accepts, the server does not reply: it is stopped).
        Exception: TCPStore's own failure to connect, as raised.
    """
    deadline = time.monotonic() + timeout_s
    import torch.distributed as dist

    if not _connect_lock.acquire(timeout=min(timeout_s, threading.TIMEOUT_MAX)):
        raise Stalled(f"another connection of this process took {timeout_s:.3g} s to open")
    try:
        while True:
            before = _sockets()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Stalled(f"no connection within {timeout_s:.3g} s")
            dog = _Watchdog(remaining, functools.partial(_opened, before, port))
            try:
                tcp = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=remaining),
                                    wait_for_workers=False)
            except Exception:
                if dog.stop():
                    raise Stalled(f"no answer within {timeout_s:.3g} s") from None
                raise
            if dog.stop():
                raise Stalled(f"no answer within {timeout_s:.3g} s")
            client = _sole(tcp, prefix, before, port)
            if client is not None:
                return client
            del tcp  # a socket opened by another library at the same moment: open again
    finally:
        _connect_lock.release()
