"""A child process that reports JSON lines on stdout and takes one-line commands on stdin.

The parent's side is ``JsonChild``: it starts the command (in another host's namespaces, say, see
``bench.cluster``), reads its reports on a thread and hands them out by event name with a deadline,
never forever. The child's side is ``say``: one report, one line. A report ``{"event": "error",
...}`` is a failure the child explains; ``expect`` raises on it unless it was asked for.

Commands go through pipes, not a socket: a child in another network namespace still reaches its
parent, and a child whose parent dies reads end of file on stdin and exits.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

__all__ = ["JsonChild", "say"]


def say(**msg) -> None:
    """Report ``msg`` to the parent: one JSON line on stdout, flushed."""
    print(json.dumps(msg), flush=True)


class JsonChild:
    """A process started from ``cmd`` that speaks JSON lines (see the module docstring).

    Args:
        cmd: the argv to run.
        env: variables set (a value of None: removed) in the child's environment, over this one's.
        name: what error messages call the child.

    The child starts a session of its own: Ctrl-C at a terminal reaches the parent only, which ends
    the children itself (``close``), and ``kill`` takes the child's whole process group (a wrapper
    such as ``nsenter`` and the process it started).
    """

    def __init__(self, cmd: list[str], *, env: dict[str, str | None] | None = None, name: str = "child") -> None:
        environ = dict(os.environ)
        for k, v in (env or {}).items():
            if v is None:
                environ.pop(k, None)
            else:
                environ[k] = v
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=environ, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
            else:  # a library's own log on stdout (UCX's): kept for the failure message
                self._stderr.append(line)
        self._lines.put(None)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line)

    def expect(self, event: str, timeout_s: float = 180.0) -> dict:
        """The next report with ``event`` (reports of other events before it are dropped).

        Raises:
            TimeoutError: none came within ``timeout_s`` seconds.
            RuntimeError: the child exited first, or reported an error (unless ``event`` is "error").
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} gave no {event!r} in {timeout_s} s; stderr:\n{self.output()}") from None
                continue
            if line is None:
                self._lines.put(None)  # every later expect sees the exit too
                self.proc.wait(timeout=30)
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before {event!r}; "
                                   f"stderr:\n{self.output()}")
            msg = json.loads(line)
            if msg.get("event") == event:
                return msg
            if msg.get("event") == "error":
                raise RuntimeError(f"{self.name} reported {msg.get('type')}: {msg.get('msg')} before {event!r}; "
                                   f"stderr:\n{self.output()}")

    def output(self) -> str:
        """What it wrote besides its reports (its stderr, and libraries' logs on its stdout)."""
        return "".join(self._stderr)

    def send(self, line: str) -> None:
        """One command line to its stdin."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL its process group (the child and what it started in its session)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self, timeout_s: float = 60.0) -> int:
        """Close its stdin and wait for it to exit (killed past ``timeout_s``); returns its exit code.
        Idempotent."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(timeout=30)
