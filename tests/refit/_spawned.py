"""A spawned worker process that runs test commands in order (shared by the refit test modules).

Every wait is bounded: a worker that dies or stays silent fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

CTX = mp.get_context("spawn")


class SpawnedWorker:
    """``target(control, results, *extra)`` in a new process; ``result`` raises the worker's traceback.

    ``ctx``: the multiprocessing context, "spawn" by default; ``preloaded`` gives a forkserver that
    imported torch once, so that many workers start without importing it each."""

    def __init__(self, target, *extra, ctx=None) -> None:
        ctx = ctx if ctx is not None else CTX
        self.control, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(self.control, self.results, *extra), daemon=True)
        self.proc.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, cmd: str, **kwargs) -> None:
        self.control.put((cmd, kwargs))

    def result(self, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, value = self.results.get(timeout=0.25)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"worker {self.proc.pid} died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {self.proc.pid} gave no answer in {timeout_s} s") from None
                continue
            if status == "error":
                raise RuntimeError(f"worker {self.proc.pid} failed:\n{value}")
            return value

    def call(self, cmd: str, timeout_s: float = 60.0, **kwargs):
        self.send(cmd, **kwargs)
        return self.result(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """Ask the process to exit normally (it closes what it holds); kill it if it does not."""
        try:
            self.control.put(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        return self.proc.exitcode

    def ask_stop(self) -> None:
        """Ask the process to exit without waiting for it (``stop`` waits): stop many at once."""
        try:
            self.control.put(None)
        except (OSError, ValueError):
            pass

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)


class Workers:
    """``num`` workers running ``target``, addressed together: collectives need every rank inside
    the same command, so a command is sent to all before any answer is read."""

    def __init__(self, target, num: int, timeout_s: float = 60.0) -> None:
        self.workers = [SpawnedWorker(target) for _ in range(num)]
        self.timeout_s = timeout_s

    def call_all(self, cmd: str, kwargs=lambda r: {}):
        """``cmd`` on every worker, ``kwargs(rank)`` each; their answers in rank order."""
        for r, w in enumerate(self.workers):
            w.send(cmd, **kwargs(r))
        return [w.result(self.timeout_s) for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.stop()


def close_keys(state: dict, *keys: str) -> None:
    """Pop each of ``keys`` from a worker's ``state`` and close what it holds (absent ones skipped)."""
    for key in keys:
        obj = state.pop(key, None)
        if obj is not None:
            obj.close()


def preloaded(*modules: str):
    """A forkserver context whose server imported ``modules`` (``"torch"``, ``"warmlink.refit"``):
    its workers are forks of that server and do not import them again. One server per session."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(modules))
    return ctx


def serve(control, results, commands: dict, state: dict, reset) -> None:
    """A worker's loop: run ``commands[cmd](state, **kwargs)`` for each message until ``None`` (or
    five idle minutes), send ``("ok", value)`` or ``("error", traceback)``, and ``reset(state)`` at
    the end whatever happened. A fatal signal (a crash in native code, glibc's abort on a damaged
    heap) prints every thread's Python stack first, so the test's log shows where the worker was."""
    import faulthandler
    import traceback

    faulthandler.enable(all_threads=True)
    try:
        while True:
            try:
                msg = control.get(timeout=300)
            except queue.Empty:
                break
            if msg is None:
                break
            cmd, kwargs = msg
            try:
                results.put(("ok", commands[cmd](state, **kwargs)))
            except BaseException:  # noqa: BLE001 - sent to the test, which raises it
                results.put(("error", traceback.format_exc()))
    finally:
        reset(state)
