"""The shm reaper (Note [Leaked shm files]): leftovers it may not remove are skipped with a
warning, exit cleanup is always registered, and long-lived processes reap on their own."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from tests._ns_child import Child, free_pid
from warmlink.pool import arenas, liveness


def _files(prefix: str) -> list[str]:
    return [n for n in os.listdir(arenas.SHM_DIR) if n.startswith(prefix[:-1])]


@pytest.fixture
def leftovers():
    """A dead process's directory and another user's file, named like arenas (no lock: the pid
    decides, and it is dead); removed again afterwards."""
    dead = free_pid()
    if dead is None:
        pytest.skip("no free pid in this namespace")
    directory = os.path.join(arenas.SHM_DIR, f"wl-{dead}-d1d1d1d1-0")
    foreign = os.path.join(arenas.SHM_DIR, f"wl-{dead}-0f0f0f0f-0")
    plain = os.path.join(arenas.SHM_DIR, f"wl-{dead}-0f0f0f0f-1")
    os.mkdir(directory)
    for p in (foreign, plain):
        with open(p, "wb") as f:
            f.write(b"x")
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
    yield directory, foreign, plain
    os.rmdir(directory)
    for p in (foreign, plain):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def test_leftovers_it_cannot_remove_are_skipped_with_a_warning(leftovers, caplog) -> None:
    directory, foreign, plain = leftovers
    with caplog.at_level(logging.WARNING, logger="warmlink.pool"):
        arenas.reap_orphaned_shm()  # never raises
    assert os.path.isdir(directory) and not os.path.exists(plain)
    assert directory in caplog.text
    if os.geteuid() == 0:
        assert os.path.exists(foreign) and foreign in caplog.text  # another user's: left alone
    with caplog.at_level(logging.WARNING, logger="warmlink.pool"):
        caplog.clear()
        arenas.reap_orphaned_shm()
    assert directory not in caplog.text  # once per name: periodic reaping does not repeat it


def test_a_leftover_it_cannot_remove_fails_no_export_and_exit_still_cleans_up(leftovers) -> None:
    child = Child(["arena"])  # its first arena reaps first, meeting the leftovers
    ready = child.expect("ready")
    assert ready["name"] in _files(ready["prefix"])
    assert child.close() == 0
    assert _files(ready["prefix"]) == []


def test_a_long_lived_process_reaps_on_its_own() -> None:
    reaper = Child(["reaper", "0.2"])  # created its arena long ago; reaps every 0.2 s from then on
    victim = Child(["arena"])
    try:
        reaper.expect("ready")
        ready = victim.expect("ready")
        os.kill(ready["ns_pid"], signal.SIGKILL)
        victim.close(timeout_s=30)
        deadline = time.monotonic() + 60
        while _files(ready["prefix"]):
            assert time.monotonic() < deadline, f"{_files(ready['prefix'])} of a killed process still there after 60 s"
            time.sleep(0.1)
        assert liveness.token_alive(ready["token"], pid=ready["ns_pid"]) is False
    finally:
        reaper.close(timeout_s=30)
        victim.close(timeout_s=30)
