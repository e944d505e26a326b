"""A peer process for the transport tests: answers on a queue, every wait bounded, never hangs."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

CTX = mp.get_context("spawn")


class Child:
    """``target(control, results, *args)`` in a spawned process; ``get`` returns its next message."""

    def __init__(self, target, *args) -> None:
        self.control, self.results = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=target, args=(self.control, self.results, *args), daemon=True)
        self.proc.start()

    def get(self, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.results.get(timeout=0.5)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"child died with exit code {self.proc.exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("child did not answer") from None
                continue
            if isinstance(msg, dict) and "error" in msg:
                raise RuntimeError(f"child failed: {msg['error']}")
            return msg

    def stop(self) -> None:
        try:
            self.control.put(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=15)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
