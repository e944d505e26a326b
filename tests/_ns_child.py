"""A warmlink process that tests start in other namespaces (``unshare``) or as a plain child.

``python _ns_child.py MODE [ARGS...]``; it reports JSON lines on stdout and reads commands on stdin.

* ``arena``: lease a 4 MiB shm arena filled with 0x5A, report ``ready``, wait until stdin closes.
* ``reaper INTERVAL_S``: the same, with ``arenas.REAP_INTERVAL_S`` set first (a long-lived process).
* ``receiver ADDRESS PREFIX SECRET NUMEL SYNC``: refit version 1 of a float32 tensor ``w`` of NUMEL
  elements over shm (reporting whether it equals ``arange``), then on any stdin line refit version
  2 with the shm copies held after the first 4 KiB chunk, reporting ``pulling``: killed there, it
  dies mid-pull inside the version. SYNC ``board``: it syncs on the publisher's version board, as
  a receiver sharing the publisher's /dev/shm does; ``store``: through the store's reader counts,
  as a receiver that cannot open the board does.

Every report carries who the process is: its pid here and in the test's namespace, hostname,
shm file prefix and liveness token. The test's side is ``Child``: it starts this script (in new
PID and UTS namespaces where asked) and waits for its reports with deadlines, never forever.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time

# In new PID and UTS namespaces: set the hostname, optionally the pid the next process gets, and
# run the command as a child of the namespace's init (not exec'd: it must not be pid 1 there).
_UNSHARE = ["unshare", "--pid", "--uts", "--fork", "--kill-child", "--", "sh", "-c",
            'hostname "$1" && { [ "$2" = - ] || echo "$2" > /proc/sys/kernel/ns_last_pid; } && shift 2 && "$@"; exit $?',
            "sh"]


def free_pid() -> int | None:
    """A pid that no process of this namespace has now, near the top (allocated last), or None."""
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read())
    for pid in range(top - 2, 300, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    return None


def wait_dead(token: str, pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the lock behind ``token`` is free: a killed process's threads may still be
    exiting (its pid a zombie already) for a moment, holding its files."""
    from warmlink.pool import liveness

    deadline = time.monotonic() + timeout_s
    while liveness.token_alive(token, pid=pid) is not False:
        assert time.monotonic() < deadline, f"the lock of {token} still held {timeout_s} s after its process ended"
        time.sleep(0.05)


def namespaces_unavailable() -> str | None:
    """Why this machine cannot start a process in new PID and UTS namespaces, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    try:
        done = subprocess.run(_UNSHARE + ["wl-probe", "-", "true"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --pid --uts failed: {exc}"
    return None if done.returncode == 0 else f"unshare --pid --uts is not permitted here: {done.stderr.strip()}"


class Child:
    """This script as a child process: ``expect(event)`` returns its next report of that event.

    Args:
        args: the mode and its arguments.
        hostname: run in new PID and UTS namespaces under this hostname (None: a plain child).
        last_pid: in the new PID namespace, the pid before the one the script gets.
    """

    def __init__(self, args: list[str], *, hostname: str | None = None, last_pid: int | None = None) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), *args]
        if hostname is not None:
            cmd = _UNSHARE + [hostname, "-" if last_pid is None else str(last_pid), *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line)

    def expect(self, event: str, timeout_s: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"child gave no {event!r} in {timeout_s} s; stderr:\n{''.join(self._stderr)}") from None
                continue
            if line is None:
                self.proc.wait(timeout=30)
                raise RuntimeError(f"child exited ({self.proc.returncode}) before {event!r}; stderr:\n{''.join(self._stderr)}")
            msg = json.loads(line)
            if msg.get("event") == event:
                return msg

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self, timeout_s: float = 60.0) -> int:
        """Close its stdin and wait for it to exit (killed past ``timeout_s``); returns its exit code."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # unshare --kill-child takes the namespace down with it
            return self.proc.wait(timeout=30)


def say(**msg) -> None:
    print(json.dumps(msg), flush=True)


def who() -> dict:
    from warmlink.pool import arenas, liveness

    # /proc is the test's mount: /proc/self names this process by its pid there.
    return {"ns_pid": os.getpid(), "host_pid": int(os.readlink("/proc/self")), "hostname": socket.gethostname(),
            "prefix": arenas.shm_prefix(), "token": liveness.token()}


def arena(interval_s: float | None = None) -> None:
    from warmlink.pool import arenas, lease_arena

    if interval_s is not None:
        arenas.REAP_INTERVAL_S = interval_s
    lease = lease_arena("shm", 4 << 20)
    lease.resource.tensor.fill_(0x5A)
    say(event="ready", name=lease.resource.name, **who())
    sys.stdin.read()
    lease.release()


def receiver(address: str, prefix: str, secret: str, numel: int, sync: str) -> None:
    import torch

    from warmlink.refit import Receiver, TensorLayout, _board
    from warmlink.rendezvous import Store
    from warmlink.transport import shm

    if sync == "store":
        _board.ReaderBoard.open = classmethod(lambda cls, *args: None)

    store = Store.connect(address, prefix=prefix, timeout_s=120, secret=secret)
    target = torch.zeros(numel, dtype=torch.float32)
    rec = Receiver(store, num_publishers=1, backend="shm", install="copy", timeout_s=300)
    rec.add("w", TensorLayout.plain("w", "float32", (numel,)), target)
    report = rec.refit(version=1)
    say(event="ready", version=report.version, ok=bool(torch.equal(target, torch.arange(numel, dtype=torch.float32))),
        **who())
    sys.stdin.readline()
    calls = []

    def hold(nbytes: int) -> None:
        calls.append(nbytes)
        if len(calls) == 2:  # one chunk landed: the pull is under way, its reader count held
            say(event="pulling")
            time.sleep(3600)

    shm.CHUNK_NBYTES = 4096
    shm.fault_hook = hold
    rec.refit(version=2)
    say(event="finished")


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "arena":
        arena()
    elif mode == "reaper":
        arena(float(args[0]))
    elif mode == "receiver":
        receiver(args[0], args[1], args[2], int(args[3]), args[4])
    else:
        raise SystemExit(f"_ns_child.py: mode={mode!r} is unknown; expected arena, reaper or receiver")
