"""Tests for warmlink.pool.liveness: a process lock held for life (Note [Process locks])."""

from __future__ import annotations

import os
import signal

import pytest

from tests._ns_child import Child, wait_dead
from warmlink.pool import arenas, liveness


def _key() -> str:
    return liveness.token().split("/", 1)[0]


def test_own_token_is_alive_and_names_this_process() -> None:
    tok = liveness.token()
    assert tok is not None and tok.endswith(f"/{liveness.own_tag()}.lock")
    assert liveness.own_tag().startswith(f"wl-{os.getpid()}-")
    assert liveness.token_alive(tok, pid=os.getpid()) is True
    assert liveness.token_alive(tok) is True
    assert liveness.claim_dead(liveness.own_tag()) is None  # the reaper never claims its own process


def test_exit_removes_lock_and_files_and_reads_dead() -> None:
    child = Child(["arena"])
    ready = child.expect("ready")
    assert liveness.token_alive(ready["token"], pid=ready["ns_pid"]) is True
    assert child.close() == 0
    assert liveness.token_alive(ready["token"], pid=ready["ns_pid"]) is False
    assert not [n for n in os.listdir(arenas.SHM_DIR) if n.startswith(ready["prefix"][:-1])]


def test_killed_process_reads_dead_and_its_files_are_reaped() -> None:
    child = Child(["arena"])
    try:
        ready = child.expect("ready")
        os.kill(ready["ns_pid"], signal.SIGKILL)
        wait_dead(ready["token"], ready["ns_pid"])
        left = [n for n in os.listdir(arenas.SHM_DIR) if n.startswith(ready["prefix"][:-1])]
        assert ready["name"] in left  # SIGKILL runs no exit handler ...
        arenas.reap_orphaned_shm()  # ... the next reaper removes them, lock last
        assert not [n for n in os.listdir(arenas.SHM_DIR) if n.startswith(ready["prefix"][:-1])]
    finally:
        child.close(timeout_s=30)


@pytest.mark.parametrize("tok", [
    "", "garbage", "0" * 32 + "-1b/wl-1-deadbeef.lock/..", "../../etc/passwd",
    "0" * 32 + "-1b/../wl-1-deadbeef.lock", "0" * 32 + "-1b/wl-1-DEADBEEF.lock", None, 7,
])
def test_malformed_tokens_are_unknown(tok) -> None:
    assert liveness.token_alive(tok) is None


def test_token_not_named_for_the_peer_or_from_another_tmpfs_is_unknown() -> None:
    tok = liveness.token()
    assert liveness.token_alive(tok, pid=os.getpid() + 1) is None  # announced beside another pid
    other = "f" * 32 + "-1/" + tok.split("/", 1)[1]  # another host, or another /dev/shm
    assert liveness.token_alive(other, pid=os.getpid()) is None


def test_lock_that_is_a_symlink_or_not_ours_is_unknown_never_dead(tmp_path) -> None:
    tag = "wl-4000000000-0badf00d"  # no such pid anywhere
    path = os.path.join(arenas.SHM_DIR, f"{tag}.lock")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, path)
    try:
        assert liveness.token_alive(f"{_key()}/{tag}.lock") is None  # never followed
        assert liveness.claim_dead(tag) is None
    finally:
        os.unlink(path)
    if os.geteuid() != 0:
        return  # chown to another user needs root
    with open(path, "wb"):
        pass
    try:
        os.chown(path, 65534, 65534)
        assert liveness.token_alive(f"{_key()}/{tag}.lock") is None
        assert liveness.claim_dead(tag) is None
    finally:
        os.unlink(path)


def test_missing_lock_is_dead_for_a_token() -> None:
    tag = "wl-4000000000-0badf00e"
    assert liveness.token_alive(f"{_key()}/{tag}.lock") is False
