"""The rendezvous key-value store: a thin, fail-closed wrapper over ``torch.distributed.TCPStore``.

Every key lives under a per-job prefix (``torch.distributed.PrefixStore``), every value carries a
MAC under the job's secret (Note [Store MAC] in ``rendezvous._mac``), every wait has a timeout that
raises ``TransferTimeout`` naming the key, and every torch or OS error becomes a warmlink error that
names the store's address. JSON payloads go through ``rendezvous.schema``.

# Note [TCPStore quirks]
Found on torch 2.9+ (libuv backend) and worked around here:
- The server listens on every interface, whatever host it is given. ``_client.serve`` binds a
  socket to the asked ``host:port`` itself and hands it to TCPStore as ``master_listen_fd``, which
  the libuv server listens on as it is (measured on torch 2.13: ``ss`` shows ``127.0.0.1:port``,
  not ``*:port``) and closes when it stops. The server has no authentication: Note [Store MAC].
- ``get`` on a missing key blocks for the store-wide timeout and raises ``DistStoreError``; a
  short per-call timeout would need ``set_timeout``, which changes it for every thread. We never
  wait in TCPStore: ``try_get`` is one atomic round trip, ``compare_set(key, S, S)`` with a
  per-process random sentinel ``S`` (a missing key with a non-empty ``expected`` is left unset
  and ``expected`` comes back), and ``get`` polls it with backoff.
- A request to a server that stopped answering (SIGSTOP, a network partition) blocks for as long
  as it stays so, whatever the store's timeout or ``set_timeout`` say (torch 2.13): the client's
  socket has no timeout, and neither has the handshake of a new client. See Note [Store deadlines].
- ``add`` on a key holding a non-integer makes the *server* drop the client's connection; every
  later call on that client fails. ``add`` therefore checks the current value first, or, where
  a round trip per call is too dear, looks on a new connection when one was lost.
- A client constructed against a dead port retries with randomized delays that can overshoot its
  timeout by seconds, and logs each try. We probe the port with a plain socket until the deadline
  and only then build the TCPStore client.
- TCPStore has no ``close``: the server stops when the last reference to its object goes away.
- A value over 8 MiB makes the libuv server log "Invalid payload size" and reset the client's
  connection for good. ``set`` and ``compare_set`` refuse values over ``schema.MAX_VALUE_BYTES``
  (8 MiB less room for the MAC) before sending anything; larger data goes through ``set_blob``.

# Note [Store deadlines]
Every call ends by its limit, even when the server is stopped or the network partitions. A call's
limit is its ``timeout_s`` (default: the store's), cut to what is left of the enclosing
``Store.deadline`` blocks of this thread (``get``, ``wait_until``, a checked ``add`` and the blob
calls enter one for their round trips; a Publisher enters one per operation), but never under
``_MIN_CALL_S``: a round trip started just before a deadline still gets its chance, so a wait that
times out says what it waited for rather than that its last round trip was cut short.
- A request's limit reaches the connection's socket as its timeouts, without a thread on the warm
  path; a new connection's handshake is bounded too (Note [Bounded requests] in rendezvous._client).
- A connection whose request timed out may still receive that request's late reply, which the
  next request would read as its own: it is closed, and the next call opens a new one once the
  server answers again. A connection that was lost (the server exited or dropped it) is not
  reopened: every later call raises PeerLostError.
- TCPStore's ``set`` has no reply: sent into the socket's buffer, it returns before the server has
  it, stopped or not. ``Store.set`` follows it with a ``check`` of the key, so it returns once the
  server holds the value and raises TransferTimeout when it does not answer.
- One call at a time runs on a connection (TCPStore serializes them anyway); a call that waits
  for another thread's gives up at its own limit.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterator

from warmlink import _env
from warmlink._backoff import wait_until
from warmlink.errors import ConfigError, MetadataError, PeerLostError, TransferError, TransferTimeout, WarmlinkError
from warmlink.rendezvous import _client, _mac, schema
from warmlink.rendezvous._blobs import BlobMethods, as_bytes

__all__ = ["Store"]

logger = logging.getLogger("warmlink.rendezvous")

_MAX_KEY_CHARS = 1024
_GENERATION_PREFIX = "__generation__/"
_MIN_CALL_S = 0.25  # the least time one round trip gets. See Note [Store deadlines]


def _timeout(value: float | None, func: str, *, zero: bool = False) -> float:
    seconds = value if value is not None else _env.default_timeout_s()
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
            or not (seconds >= 0 if zero else seconds > 0)):
        raise ConfigError(f"{func}: timeout_s={seconds!r} invalid; expected a finite number of seconds "
                          f"{'>=' if zero else '>'} 0")
    return float(seconds)


def _fits(value: bytes, func: str, key: str) -> bytes:
    if len(value) > schema.MAX_VALUE_BYTES:
        raise MetadataError(
            f"{func}: key={key!r}: value of {len(value)} bytes exceeds the store's limit; expected at most "
            f"{schema.MAX_VALUE_BYTES} bytes per value (TCPStore drops the connection past it; use Store.set_blob)"
        )
    return value


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def _check_counter(key: str, current: bytes | None) -> None:
    """Raise MetadataError unless ``current`` (``key``'s value, None when absent) is an integer."""
    if current is None:
        return
    try:
        int(current.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise MetadataError(f"Store.add: key={key!r} holds {current[:40]!r}, not an integer; expected a counter key "
                            "(written by a process without the job's secret?); nothing added") from None


def _counter(value: int, func: str, key: str) -> int:
    """A counter read back: counters carry no MAC (Note [Store MAC]), so one that another writer
    pushed near int64's ends is refused before the server's next add could overflow it."""
    if not -(1 << 62) <= value < 1 << 62:
        raise MetadataError(f"{func}: key={key!r} holds the counter {value}; expected an integer of magnitude < 2**62")
    return value


class Store(BlobMethods):
    """Rendezvous key-value store. Owns the TCPStore server when ``is_server=True``.

    Args:
        host: address clients connect to (and, for the server, that it is reached at).
        port: TCP port; ``0`` with ``is_server=True`` lets the OS pick a free one (see ``.port``).
        is_server: start the TCPStore server in this process; it lives until ``close()``.
        prefix: namespace of every key, e.g. one per job; two prefixes never see each other's keys
            (unless one is a ``/``-extension of the other and keys are chosen to collide).
        timeout_s: default limit in seconds for connecting, for every call and every wait; ``None``
            takes ``WARMLINK_TIMEOUT_S`` (default 60). See Note [Store deadlines].
        world_size: number of processes expected to connect (informational for TCPStore; this
            class never waits for workers).
        secret: the job's secret, under which every value carries a MAC (Note [Store MAC] in
            ``rendezvous._mac``): a str of 16 to 1024 UTF-8 bytes, the same in every process.
            ``None`` takes ``WARMLINK_SECRET``; a server with neither makes a fresh one, read
            back as ``.secret`` (Note [Store secret] in ``rendezvous._mac``).

    The server listens on ``host`` only (loopback by default): across nodes, pass the address of
    this node that the others reach, and set ``WARMLINK_SECRET`` on every process.

    Raises:
        ConfigError: invalid argument, a client without a secret, or the server port is already in use.
        TransferTimeout: a client found no server at ``host:port``, or the server did not answer,
            within ``timeout_s``.

    Collective? No. Blocking? A client blocks until it connects (at most ``timeout_s``); every
    call blocks at most its limit (Note [Store deadlines]). Thread-safe: calls run one at a time.
    Warm path? No: create one store per process and keep it.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        is_server: bool = False,
        prefix: str = "warmlink",
        timeout_s: float | None = None,
        world_size: int | None = None,
        secret: str | None = None,
    ) -> None:
        self._closed = True
        self._server: Any = None  # the TCPStore server, when this store owns it
        self._client: _client.Client | None = None  # None: opened on next use (Note [Store deadlines])
        self._lost: str | None = None  # why the connection was lost for good
        self._lock = threading.Lock()
        self._scope = threading.local()  # .at: this thread's Store.deadline
        self.timeout_s = _timeout(timeout_s, "Store")
        if not isinstance(host, str) or not host:
            raise ConfigError(f"Store: host={host!r} invalid; expected a non-empty host name or IP address")
        if isinstance(port, bool) or not isinstance(port, int) or not (0 if is_server else 1) <= port <= 65535:
            raise ConfigError(f"Store: port={port!r} out of range; expected {0 if is_server else 1} <= port <= 65535")
        if not isinstance(prefix, str) or not prefix or len(prefix) > 256:
            raise ConfigError(f"Store: prefix={prefix!r} invalid; expected 1 to 256 characters")
        if world_size is not None and (type(world_size) is not int or world_size < 1):
            raise ConfigError(f"Store: world_size={world_size!r} invalid; expected None or an int >= 1")
        self.host, self.port, self.prefix, self.is_server = host, port, prefix, is_server
        secret = secret if secret is not None else _env.secret()
        if secret is None and not is_server:
            raise ConfigError(
                f"Store: no secret for the store at {self.address}; expected secret=<the server's Store.secret> or "
                "WARMLINK_SECRET set, on every process of the job, to the secret the server was given"
            )
        self._secret = _env.check_secret(secret, "Store") if secret is not None else secrets.token_hex(32)
        self._mac = _mac.Mac(self._secret, prefix)
        self._absent = b"\x00warmlink-absent\x00" + os.urandom(16)  # See Note [TCPStore quirks]
        importlib.import_module("torch.distributed")  # before any deadline starts: its first import can take seconds
        if is_server:
            try:
                self._client = _client.serve(host, port, prefix, self.timeout_s, world_size)
            except Exception as e:  # noqa: BLE001 - every torch error becomes a typed warmlink error
                raise ConfigError(
                    f"Store: cannot start a store server on {host}:{port} ({_first_line(e)}); expected a free port"
                ) from None
            self._server = self._client.tcp
            self.port = int(self._server.port)
        else:
            deadline = time.monotonic() + self.timeout_s
            self._probe(deadline, wait=True)
            self._client = self._connect(deadline, "Store")
        self._closed = False
        logger.debug("store %s at %s prefix=%s", "server" if is_server else "client", self.address, prefix)

    @classmethod
    def connect(cls, address: str, *, prefix: str = "warmlink", timeout_s: float | None = None,
                secret: str | None = None) -> "Store":
        """Connect a client to the server at ``"host:port"`` (IPv6 as ``"[::1]:port"``) under the
        job's ``secret`` (``None``: ``WARMLINK_SECRET``; Note [Store secret] in ``rendezvous._mac``).

        Raises:
            ConfigError: the address does not parse, or no secret was given. TransferTimeout: no
                server, or no answer from it, within ``timeout_s``.
        """
        host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"Store.connect: address={address!r} invalid; expected 'host:port'")
        return cls(host, int(port), is_server=False, prefix=prefix, timeout_s=timeout_s, secret=secret)

    @property
    def secret(self) -> str:
        """The job's secret, for a launcher to hand to the processes it starts (as an argument:
        never log it). See Note [Store secret] in ``rendezvous._mac``."""
        return self._secret

    @property
    def address(self) -> str:
        """``"host:port"`` that clients pass to ``Store.connect``."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _probe(self, deadline: float, *, wait: bool) -> None:
        """Wait until something accepts TCP connections at host:port (``wait=False``: PeerLostError
        when nothing does now). See Note [TCPStore quirks]."""
        last = ["no attempt"]

        def accepts() -> bool:
            try:
                attempt_s = min(max(deadline - time.monotonic(), 1e-3), 1.0)
                socket.create_connection((self.host, self.port), timeout=attempt_s).close()
                return True
            except OSError as e:
                last[0] = f"{type(e).__name__}: {e}"
                if not wait and not isinstance(e, TimeoutError):
                    raise PeerLostError(f"Store: the store server at {self.address} is gone ({last[0]})") from None
                return False

        limit_s = max(deadline - time.monotonic(), 0.0)
        wait_until(accepts, timeout_s=limit_s, first_s=0.005, cap_s=0.1, what=lambda: (
            f"Store: no store server at {self.host}:{self.port} after {limit_s:.3g} s (last error: {last[0]}); "
            "expected a Store(is_server=True) listening there"))

    def _connect(self, deadline: float, func: str) -> _client.Client:
        """A new connection, its handshake done by ``deadline``. See Note [Store deadlines]."""
        limit_s = max(deadline - time.monotonic(), 0.001)
        try:
            return _client.connect(self.host, self.port, self.prefix, limit_s)
        except _client.Stalled as e:
            raise TransferTimeout(
                f"{func}: the store at {self.address} accepts connections but did not answer within {limit_s:.3g} s "
                f"({e}); its server process may be stopped or the network partitioned"
            ) from None
        except Exception as e:  # noqa: BLE001 - every torch error becomes a typed warmlink error
            raise TransferTimeout(
                f"{func}: cannot connect to the store at {self.address} within {limit_s:.3g} s ({_first_line(e)})"
            ) from None

    def _limit(self, timeout_s: float | None, func: str) -> float:
        """Seconds the next call may take: ``timeout_s`` (None: the store's), cut to this thread's
        ``Store.deadline``, at least ``_MIN_CALL_S``. See Note [Store deadlines]."""
        limit_s = self.timeout_s if timeout_s is None else _timeout(timeout_s, func)
        at = getattr(self._scope, "at", None)
        if at is not None:
            limit_s = min(limit_s, max(at - time.monotonic(), _MIN_CALL_S))
        return limit_s

    @contextlib.contextmanager
    def deadline(self, timeout_s: float | None = None) -> Iterator[None]:
        """Within the block, every call this thread makes on this store ends within ``timeout_s``
        seconds of entering it (``None``: the store's ``timeout_s``).

        A call's own ``timeout_s`` still applies when it ends sooner; blocks nest (the earliest end
        wins); a call made near or past the end still gets ``_MIN_CALL_S`` (0.25 s) for its round
        trip. See Note [Store deadlines].

        Raises:
            ConfigError: ``timeout_s`` is not a finite number of seconds >= 0.

        Blocking? No. Warm path? One thread-local read per call.
        """
        at = time.monotonic() + _timeout(timeout_s if timeout_s is not None else self.timeout_s, "Store.deadline",
                                         zero=True)
        scope = self._scope
        outer = getattr(scope, "at", None)
        scope.at = at if outer is None else min(at, outer)
        try:
            yield
        finally:
            scope.at = outer

    def _call(self, op: str, key: str, method: str, *args: Any, limit_s: float, nbytes: int = 0,
              confirm: bool = False) -> Any:
        """Run ``PrefixStore.<method>(*args)`` within ``limit_s`` seconds (``confirm``: then a
        ``check`` of ``key``, for requests without a reply), turning every torch/OS error into a
        warmlink error. See Note [Store deadlines]."""
        if self._closed:
            raise PeerLostError(f"Store.{op}: key={key!r}: store {self.address} is closed")
        lock = self._lock
        if not (lock.acquire(False) or lock.acquire(timeout=min(limit_s, threading.TIMEOUT_MAX))):
            raise TransferTimeout(f"Store.{op}: key={key!r}: another thread's call on the store at {self.address} "
                                  f"held its connection for {limit_s:.3g} s; expected it to end within its limit")
        deadline = time.monotonic() + limit_s
        client = self._client
        try:
            if client is None:
                if self._lost is not None:
                    raise PeerLostError(f"Store.{op}: key={key!r}: the connection to the store at {self.address} was "
                                        f"lost ({self._lost}); the server process may have exited")
                self._probe(deadline, wait=False)
                client = self._client = self._connect(deadline, f"Store.{op}")
                limit_s = max(deadline - time.monotonic(), _MIN_CALL_S)
            result = client.call(method, args, limit_s, nbytes)
            if confirm:
                client.call("check", ([key],), max(deadline - time.monotonic(), _MIN_CALL_S))
            return result
        except _client.Stalled:
            raise TransferTimeout(
                f"Store.{op}: key={key!r}: the store at {self.address} did not answer within {limit_s:.3g} s; its "
                "server process may be stopped or the network partitioned (the next call reconnects)"
            ) from None
        except Exception as e:  # noqa: BLE001 - translated or passed on by _failure
            raise self._failure(op, key, e, client) from None
        finally:
            if client is not None and client.broken and self._client is client:
                self._client = None
                client.close()
            lock.release()

    def _failure(self, op: str, key: str, e: Exception, client: _client.Client | None) -> Exception:
        """The warmlink error for torch/OS error ``e`` of a call (``e`` itself for any other)."""
        import torch.distributed as dist

        if isinstance(e, dist.DistNetworkError):
            logger.debug("store %s op=%s key=%s failed: %s", self.address, op, key, _first_line(e))
            self._lost = _first_line(e)
            if client is not None:
                client.broken = True
            return PeerLostError(
                f"Store.{op}: key={key!r}: lost the connection to the store at {self.address} ({_first_line(e)}); "
                "the server process may have exited"
            )
        if isinstance(e, dist.DistStoreError):
            return TransferTimeout(f"Store.{op}: key={key!r}: store at {self.address} timed out ({_first_line(e)})")
        if isinstance(e, (RuntimeError, OSError, ValueError, TypeError)) and not isinstance(e, WarmlinkError):
            return TransferError(f"Store.{op}: key={key!r}: store at {self.address} failed ({_first_line(e)})")
        return e

    @staticmethod
    def _key(key: str, func: str) -> str:
        if not isinstance(key, str) or not 1 <= len(key) <= _MAX_KEY_CHARS:
            raise ConfigError(
                f"Store.{func}: key={key!r} invalid; expected a string of 1 to {_MAX_KEY_CHARS} characters"
            )
        return key

    # -- primitives: each takes timeout_s, seconds (None: the store's); Note [Store deadlines] -------
    def set(self, key: str, value: bytes | str, *, timeout_s: float | None = None) -> None:
        """Store ``value`` (bytes, or str as UTF-8) under ``key``, replacing any old value; returns
        once the server holds it (two round trips: TCPStore's ``set`` has no reply of its own).

        Raises:
            MetadataError: ``value`` is over ``schema.MAX_VALUE_BYTES`` (8 MiB less 64 bytes); nothing is sent and
                the connection stays usable. Larger data goes through ``set_blob``.
            TransferTimeout: the store did not take it within ``timeout_s``.
        """
        value = _fits(as_bytes(value, "Store.set", key), "Store.set", self._key(key, "set"))
        value = self._mac.seal(key, value)
        self._call("set", key, "set", key, value, limit_s=self._limit(timeout_s, "Store.set"), nbytes=len(value),
                   confirm=True)

    def try_get(self, key: str, *, timeout_s: float | None = None, peer: str | None = None) -> bytes | None:
        """The value under ``key``, or ``None`` if it is absent. One round trip, never a wait for
        the key; at most ``timeout_s`` when the server does not answer (TransferTimeout).

        Raises:
            MetadataError: the value fails its MAC (Note [Store MAC]): it names ``key`` and
                ``peer``, the writer the caller expects, where given. Nothing of it is returned.
        """
        value = self._fetch(key, "try_get", self._limit(timeout_s, "Store.try_get"))
        return None if value is None else self._open(key, value, "try_get", peer)

    def _fetch(self, key: str, op: str, limit_s: float) -> bytes | None:
        """The bytes stored under ``key`` as they are (MAC and all), or None when absent."""
        self._key(key, op)
        value = self._call(op, key, "compare_set", key, self._absent, self._absent, limit_s=limit_s)
        return None if value == self._absent else bytes(value)

    def _open(self, key: str, stored: bytes, op: str, peer: str | None) -> bytes:
        value = self._mac.open(key, stored)
        if value is None:
            raise MetadataError(
                f"Store.{op}: key={key!r}{'' if peer is None else f' from peer={peer!r}'}: the value ({len(stored)} "
                f"bytes) fails its MAC; expected one written under this job's secret (it was written by a process "
                f"with another secret: a peer given the wrong secret= or WARMLINK_SECRET, or an earlier job that used "
                f"prefix {self.prefix!r} on this store, which a prefix per job avoids; or altered in the store at "
                f"{self.address}); refused"
            )
        return value

    def get(self, key: str, *, timeout_s: float | None = None, peer: str | None = None) -> bytes:
        """Wait until ``key`` exists and return its value.

        Args:
            key: key under this store's prefix.
            timeout_s: seconds to wait; ``None`` uses the store's ``timeout_s``.
            peer: who is expected to have written it, for the error message.

        Raises:
            TransferTimeout: ``key`` did not appear in time (names the key), or the store did not answer.
            PeerLostError: the server went away.
            MetadataError: the value fails its MAC (names ``key`` and ``peer``).
        """
        found: list[bytes] = []

        def present() -> bool:
            value = self.try_get(key, peer=peer)
            if value is not None:
                found.append(value)
            return value is not None

        self.wait_until(present, what=f"key={key!r}", timeout_s=timeout_s)
        return found[0]

    def add(self, key: str, amount: int, *, checked: bool = True, timeout_s: float | None = None) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (absent counts as 0); returns the sum.

        Args:
            checked: first check that ``key`` holds an integer (one more round trip). Counters that
                only warmlink's own protocol writes (reader counts, generations) pass False: the
                server then drops this client's connection on a corrupted one, and a new connection
                finds the garbage (MetadataError naming the key), instead of a round trip on every
                refit.
            timeout_s: seconds for both round trips together.

        Counters carry no MAC (Note [Store MAC]): whatever another writer put there, the sum comes
        back as an int of magnitude < 2**62, or raises.

        Raises:
            MetadataError: ``key`` holds something that is not an integer (checked), or the sum is
                out of that range. See Note [TCPStore quirks].
        """
        self._key(key, "add")
        if isinstance(amount, bool) or not isinstance(amount, int) or not -(1 << 62) <= amount < 1 << 62:
            raise ConfigError(f"Store.add: amount={amount!r} invalid; expected an int of magnitude < 2**62")
        if not checked:
            try:
                return _counter(int(self._call("add", key, "add", key, amount, limit_s=self._limit(timeout_s, "Store.add"))),
                                "Store.add", key)
            except PeerLostError as lost:
                # The server drops a client whose add meets a non-integer (Note [TCPStore quirks]):
                # anyone who reaches the port can write one. Reconnect once and look, so the garbage
                # costs this call a MetadataError naming the key, not the connection for good.
                return self._add_again(key, amount, timeout_s, lost)
        with self.deadline(self._limit(timeout_s, "Store.add")):
            _check_counter(key, self._fetch(key, "add", self._limit(None, "Store.add")))  # a counter: no MAC to open
            return _counter(int(self._call("add", key, "add", key, amount, limit_s=self._limit(None, "Store.add"))),
                            "Store.add", key)

    def _add_again(self, key: str, amount: int, timeout_s: float | None, lost: PeerLostError) -> int:
        """After an unchecked ``add`` lost the connection: on a new one, MetadataError naming ``key``
        when it holds a non-integer (the add was refused, nothing applied); else the loss stands,
        for the add may have been applied before the reply was lost and must not be made twice."""
        with self._lock:
            if self._client is None and self._lost is not None:
                self._lost = None  # let the next call connect again
        try:
            with self.deadline(self._limit(timeout_s, "Store.add")):
                current = self._fetch(key, "add", self._limit(None, "Store.add"))
        except (PeerLostError, TransferTimeout):
            with self._lock:
                if self._client is None:
                    self._lost = str(lost)
            raise lost from None
        _check_counter(key, current)
        raise lost

    def compare_set(self, key: str, expected: bytes, desired: bytes, *, timeout_s: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is absent and ``expected == b""``).

        Returns:
            The value now stored; the swap happened iff it equals ``desired``. (TCPStore returns
            ``expected`` when the key is absent and ``expected`` is non-empty.) Both go in sealed
            (``b""``, for absent, as it is) and what comes back is opened: Note [Store MAC].

        Raises:
            MetadataError: the value now stored fails its MAC (names ``key``).
        """
        self._key(key, "compare_set")
        exp, des = (_fits(as_bytes(v, "Store.compare_set", key), "Store.compare_set", key) for v in (expected, desired))
        exp, des = (exp and self._mac.seal(key, exp)), self._mac.seal(key, des)
        now = bytes(self._call("compare_set", key, "compare_set", key, exp, des,
                               limit_s=self._limit(timeout_s, "Store.compare_set"), nbytes=len(exp) + len(des)))
        return self._open(key, now, "compare_set", None)

    def delete(self, key: str, *, timeout_s: float | None = None) -> bool:
        """Remove ``key``; returns whether it existed."""
        return bool(self._call("delete", key, "delete_key", self._key(key, "delete"),
                               limit_s=self._limit(timeout_s, "Store.delete")))

    def wait_until(
        self, predicate: Callable[[], bool], *, what: str, timeout_s: float | None = None, poll_s: float = 0.005
    ) -> None:
        """Poll ``predicate`` until it returns True, sleeping 50 us first and doubling up to ``poll_s``.

        Args:
            predicate: called on this thread inside ``deadline(timeout_s)``, so that its calls on
                this store end with the wait; its WarmlinkErrors propagate.
            what: what is awaited, for the error message.
            timeout_s: seconds; ``None`` uses the store's ``timeout_s``.
            poll_s: longest sleep between polls, in seconds.

        Raises:
            TransferTimeout: ``"... waiting for {what} ..."`` after ``timeout_s``.
        """
        limit_s = _timeout(timeout_s if timeout_s is not None else self.timeout_s, "Store.wait_until")
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not 0 < poll_s <= 1:
            raise ConfigError(f"Store.wait_until: poll_s={poll_s!r} invalid; expected 0 < poll_s <= 1 seconds")
        with self.deadline(limit_s):
            wait_until(predicate, timeout_s=limit_s, first_s=min(50e-6, poll_s), cap_s=poll_s, what=lambda: (
                f"Store.wait_until: timed out after {limit_s:.3g} s waiting for {what} "
                f"(store {self.address}, prefix={self.prefix!r}); the peer that writes it may be slow or dead"))

    # -- JSON and counters ------------------------------------------------------------------------
    def set_json(self, key: str, obj: dict, *, timeout_s: float | None = None) -> None:
        """Validate ``obj`` with ``schema.encode`` and store it under ``key``. Raises MetadataError."""
        self.set(key, schema.encode(obj), timeout_s=timeout_s)

    def get_json(self, key: str, expected_kind: str, peer: str, *, timeout_s: float | None = None) -> dict:
        """Wait for ``key`` and return its payload, validated by ``schema.decode(raw, expected_kind, peer)``.
        Raises MetadataError naming ``key`` and ``peer`` for a value that fails its MAC."""
        return schema.decode(self.get(key, timeout_s=timeout_s, peer=peer), expected_kind, peer)

    def next_generation(self, slot: str, *, timeout_s: float | None = None) -> int:
        """Bump and return the generation counter of ``slot`` (e.g. ``"pub/1"``); the first call returns 1."""
        return self.add(_GENERATION_PREFIX + self._key(slot, "next_generation"), 1, checked=False, timeout_s=timeout_s)

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the connection; a server store also stops serving every client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            client.close()
        self._server = None  # TCPStore has no close(); dropping it stops the server
        logger.debug("store %s closed", self.address)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound now: module globals are gone at exit
        # At interpreter exit modules are already torn down: nothing useful can be said then.
        if getattr(self, "_closed", True) or _finalizing():
            return
        warnings.warn(f"Store at {self.address} was not closed; call close()", ResourceWarning, stacklevel=2)
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("server" if self.is_server else "client")
        return f"Store({self.address}, prefix={self.prefix!r}, {state})"

