"""examples/refit_job.py when a rank dies: the launcher takes the job down, names the rank, exits 1.

(The run that succeeds is the README's own command: tests/refit/test_readme.py.) CPU, shm.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from warmlink.pool.liveness import pid_alive  # (a zombie has exited)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "refit_job.py"
LIMIT_S = 240.0  # for each wait below; generous: ranks import torch on loaded cores


def _launch(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: a test that fails can end it and its ranks


def _end(proc: subprocess.Popen) -> None:
    """Whatever the test found: the launcher and every rank it started are gone."""
    if proc.poll() is None:
        proc.terminate()  # the launcher stops its ranks on SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # ranks left behind by a launcher that failed to stop them
    except ProcessLookupError:
        pass
    proc.wait(30)


class _Lines:
    """The launcher's output lines (its ranks' too), read on a thread so that every wait is bounded."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._q.put(line) for line in proc.stdout] + [self._q.put(None)],
                         daemon=True).start()

    def until(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout_s} s; output:\n{''.join(self.seen)}") from None
            if line is None:
                raise AssertionError(f"output ended before a line matching {pattern!r}:\n{''.join(self.seen)}")
            self.seen.append(line)
            found = re.search(pattern, line)
            if found:
                return found

    def rest(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
        return "".join(self.seen)


def test_a_killed_engine_takes_the_job_down_and_is_named():
    proc = _launch("--steps", "100000", "--device", "cpu", "--timeout", "60", "--job-timeout", "600")
    try:
        lines = _Lines(proc)
        trainers = [int(lines.until(rf"started trainer {r} \(pid (\d+)\)", LIMIT_S)[1]) for r in range(2)]
        engine = int(lines.until(r"started engine 0 \(pid (\d+)\)", LIMIT_S)[1])
        lines.until(r"^engine 0: installed version 2:", LIMIT_S)  # mid-job: trainers wait on it every step
        os.kill(engine, signal.SIGKILL)
        rc = proc.wait(timeout=LIMIT_S)  # the launcher stops the trainers: SIGTERM, SIGKILL after its grace
        out = lines.rest(30.0)
    finally:
        _end(proc)
    assert rc == 1, out
    assert re.search(rf"^launcher: job failed: engine 0 \(pid {engine}\) was killed by SIGKILL; "
                     r"stopped trainer 0, trainer 1$", out, flags=re.M), out
    assert "check OK" not in out
    assert not [pid for pid in trainers if pid_alive(pid)], "a trainer rank outlived its launcher"


def test_help_says_how_the_secret_goes_and_in_what_order_ranks_close():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60, check=True)
    text = " ".join(out.stdout.split())
    for said in ("Store(is_server=True)", "never on a command line", "WARMLINK_SECRET", "Engines close first, then trainers",
                 "then the store", "exit 1", "--job-timeout"):
        assert said in text, f"--help does not say {said!r}:\n{out.stdout}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_job_on_gpus_checks_the_weights():
    """The default on a GPU host: NCCL trainer ranks (one per GPU, at most 2), cuda_ipc engines."""
    proc = _launch("--engines", "2")
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    finally:
        _end(proc)
    assert proc.returncode == 0, out
    assert re.search(r"^launcher: .* on cuda$", out, flags=re.M), out
    assert re.search(r"^check OK: 2 engine\(s\) held the trainer's weights bit for bit at versions 1\.\.4$", out,
                     flags=re.M), out
