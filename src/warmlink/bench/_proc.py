"""Child processes for benchmarks: spawn, talk in plain dicts, never hang, never leak.

Every child gets the multicast-off variables (see DESIGN: NVLink multicast can take a shared
host's GPUs down). Every wait has a deadline; a child that dies or reports an error takes the
whole group down and the parent raises with the child's traceback.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading
import time
import traceback
from typing import Callable

__all__ = ["SAFE_ENV", "Group", "Outbox", "free_port", "run_in_child"]

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A TCP port free on the loopback now (for a ``torch.distributed`` group of the bench's ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Outbox:
    """A child's end of its own pipe to the parent; ``put(msg)`` sends one dict.

    One pipe per child, not one queue for all: a ``multiprocessing.Queue``'s writers share one
    lock, and a child SIGKILLed while its feeder thread still held it (the parent had already read
    the child's last message) froze every other child's messages for good. ``bench reconfigure``
    kills replaced processes and timed out that way in 2 of 13 runs.
    """

    def __init__(self, conn) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"conn": self._conn}

    def __setstate__(self, state) -> None:
        self._conn, self._lock = state["conn"], threading.Lock()

    def put(self, msg: dict) -> None:
        with self._lock:  # several threads of a child may report
            self._conn.send(msg)


def _child(fn: Callable, kwargs: dict, control, results, tag: str) -> None:
    os.environ.update(SAFE_ENV)
    if hasattr(signal, "SIGUSR1"):  # a parent that times out asks for every thread's stack
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        fn(control=control, results=results, **kwargs)
    except BaseException:
        results.put({"tag": tag, "event": "error", "traceback": traceback.format_exc()})


class Group:
    """Processes started together; ``expect`` collects their messages in order of arrival."""

    def __init__(self, timeout_s: float) -> None:
        import multiprocessing as mp

        os.environ.update(SAFE_ENV)
        self._ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.procs: dict[str, object] = {}
        self.controls: dict[str, object] = {}
        self._inbox: dict[str, object] = {}  # tag -> the read end of that child's Outbox
        self._backlog: list[dict] = []  # messages of other events, kept for a later expect

    def start(self, tag: str, fn: Callable, **kwargs) -> None:
        control = self._ctx.Queue()
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_child, args=(fn, kwargs, control, Outbox(writer), tag), daemon=True,
                                 name=f"warmlink-{tag}")
        proc.start()
        writer.close()  # the child holds the only write end: its exit reads as end of file
        self.procs[tag], self.controls[tag], self._inbox[tag] = proc, control, reader

    def _receive(self, timeout_s: float) -> list[dict]:
        """Messages that arrive within ``timeout_s``, from any child; a closed pipe is dropped."""
        from multiprocessing.connection import wait

        readers = {conn: tag for tag, conn in self._inbox.items()}
        if not readers:
            time.sleep(timeout_s)
            return []
        out = []
        for conn in wait(list(readers), timeout=timeout_s):
            try:
                out.append(conn.recv())
            except (EOFError, OSError):  # that child exited (or was killed): nothing more will come
                self._inbox.pop(readers[conn], None)
                conn.close()
        return out

    def send(self, tag: str, msg) -> None:
        self.controls[tag].put(msg)

    def expect(self, event: str, count: int, timeout_s: float | None = None) -> list[dict]:
        """Wait for ``count`` messages with ``event`` (earlier messages of other events are kept for
        their own ``expect``); RuntimeError on a child error, death or timeout."""
        deadline = time.perf_counter() + (timeout_s if timeout_s is not None else self.timeout_s)
        got = [m for m in self._backlog if m.get("event") == event][:count]
        self._backlog = [m for m in self._backlog if not any(m is g for g in got)]
        while len(got) < count:
            msgs = self._receive(0.5)
            if not msgs:
                dead = {t: p.exitcode for t, p in self.procs.items() if not p.is_alive() and p.exitcode != 0}
                if dead:
                    raise RuntimeError(f"bench: child process(es) died: {dead}")
                if time.perf_counter() > deadline:
                    where = self._dump_stacks()
                    raise RuntimeError(f"bench: timed out waiting for {count} x {event!r} (got {len(got)}){where}")
                continue
            for msg in msgs:
                if msg.get("event") == "error":
                    raise RuntimeError(f"bench: {msg['tag']} failed:\n{msg['traceback']}")
                (got if msg.get("event") == event and len(got) < count else self._backlog).append(msg)
        return got

    def _dump_stacks(self) -> str:
        """Ask every live child to write its threads' stacks to stderr: a hang says where it is."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        alive = [t for t, p in self.procs.items() if p.is_alive()]
        for tag in alive:
            try:
                os.kill(self.procs[tag].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(0.5)  # let them write before the parent's error follows
        return f"; stacks of {alive} written to stderr" if alive else ""

    def close(self) -> None:
        for tag in self.procs:
            try:
                self.controls[tag].put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 15
        while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
            self._receive(0.05)  # drained, so that no child blocks on a full pipe while it exits
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            else:
                p.join()
        for conn in self._inbox.values():
            conn.close()
        self._inbox.clear()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _call(target: Callable, control, results, **kwargs) -> None:
    results.put({"event": "result", "value": target(**kwargs)})


def run_in_child(fn: Callable, timeout_s: float = 600, **kwargs):
    """Run ``fn(**kwargs)`` in a fresh spawned process and return its (JSON-able) result."""
    with Group(timeout_s) as group:
        group.start("child", _call, target=fn, **kwargs)
        return group.expect("result", 1)[0]["value"]
