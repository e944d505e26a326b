"""A rendezvous store server in a child process that a test can SIGSTOP: the "stalled store" of
Note [Store deadlines] in warmlink.rendezvous.store.

Calls are run on a helper thread and joined for their limit plus ``MARGIN_S``: code that blocks
past that fails its test at once (the thread is released when the server is continued), instead of
hanging the suite. Only an upper bound is asserted, never speed: a loaded machine can make a call
slower, not faster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from warmlink.errors import TransferTimeout

MARGIN_S = 1.0  # every call raises within its limit plus this (issue 21)

# PR_SET_PDEATHSIG: SIGKILL ends a stopped process too, so a test run that dies never leaves a
# stopped server behind.
_SERVER = r"""
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[2]):
    sys.exit(1)
from warmlink.rendezvous import Store
store = Store("127.0.0.1", 0, is_server=True, prefix=sys.argv[1], timeout_s=60)
print(store.address, store.secret, flush=True)  # to the parent, over its pipe
sys.stdin.read()  # until the test closes the pipe
"""


class StoppableServer:
    """A ``Store(is_server=True)`` in a child process; ``stopped()`` SIGSTOPs it for a block."""

    def __init__(self, name: str) -> None:
        self.prefix = prefix = f"{name}-{uuid.uuid4().hex[:8]}"
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, prefix, str(os.getpid())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.address, _, self.secret = self.proc.stdout.readline().strip().partition(" ")
        if not self.address:
            self.close()
            raise RuntimeError("the store server child printed no address")

    def _state(self) -> str:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    @contextlib.contextmanager
    def stopped(self):
        """The server is stopped (its state is T) inside the block, and continued after it."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while self._state() != "T":
                assert time.monotonic() < deadline, "the store server did not stop"
                time.sleep(0.001)
            yield self
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def within(fn: Callable[[], Any], limit_s: float) -> tuple[BaseException | None, float]:
    """Run ``fn`` on a helper thread; ``(what it raised or None, seconds it took)``.

    Fails (AssertionError) when ``fn`` is still running ``limit_s + MARGIN_S`` seconds after it
    started: the thread stays blocked until the server is continued.
    """
    box: list = []

    def run() -> None:
        start = time.monotonic()
        try:
            fn()
            box.append((None, time.monotonic() - start))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append((exc, time.monotonic() - start))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s + MARGIN_S)
    assert box, f"still blocked {limit_s + MARGIN_S:.3g} s after the call started (its limit: {limit_s:.3g} s)"
    return box[0]


@contextlib.contextmanager
def stoppable_server(name: str) -> Iterator[StoppableServer]:
    """A ``StoppableServer`` for a block, killed after it; its prefix is ``name`` made unique."""
    server = StoppableServer(name)
    try:
        yield server
    finally:
        server.close()


def times_out(fn: Callable[[], Any], limit_s: float) -> TransferTimeout:
    """What ``fn`` raised: a TransferTimeout, within ``limit_s + MARGIN_S`` and not before ``limit_s``."""
    exc, took = within(fn, limit_s)
    assert isinstance(exc, TransferTimeout), f"expected TransferTimeout, got {exc!r}"
    assert took > limit_s - 0.1, f"gave up after {took:.3f} s, before its limit of {limit_s} s"
    return exc
