"""Readers, publishers and arenas of processes in other PID and UTS namespaces sharing this host's
/dev/shm (containers with ``--ipc=host``): a dead one is reaped, a live one is left alone and
refit from.

See Note [Process locks] in ``warmlink.pool.liveness`` and Note [Reader slots] in
``warmlink.refit.protocol``. The children run under ``unshare --pid --uts`` (root, or a
kernel that lets this user make namespaces); where that is not permitted the tests skip and
say why. Every wait is bounded with a wide margin: two loaded cores must not fail them.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import uuid

import pytest
import torch

from tests._ns_child import Child, free_pid, namespaces_unavailable, wait_dead
from warmlink.pool import arenas, liveness
from warmlink.refit import Publisher, Receiver, TensorLayout, protocol
from warmlink.rendezvous import Store

NUMEL = 1 << 16  # 256 KiB of float32: 64 chunks of 4 KiB, so the kill lands mid-pull


@pytest.fixture(scope="module", autouse=True)
def _namespaces():
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)


def _files(prefix: str) -> list[str]:
    tag = prefix[:-1]
    return sorted(n for n in os.listdir(arenas.SHM_DIR) if n.startswith(prefix) or n == f"{tag}.lock")


def _board_held(pub: Publisher) -> bool:
    """Whether a receiver holds ``pub``'s version board (Note [Version board])."""
    fd = os.open(os.path.join(arenas.SHM_DIR, pub._board.desc["name"]), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize("sync", ["board", "store"])
def test_reader_killed_in_another_namespace_and_hostname_is_reaped(sync: str) -> None:
    """Dead mid-pull, the reader lets the next update in: through the board its lock went with it;
    through the store its process lock is free, so the publisher reaps its count."""
    w = torch.arange(NUMEL, dtype=torch.float32)
    layout = TensorLayout.plain("w", "float32", (NUMEL,))
    child = rec = None
    with Store("127.0.0.1", 0, is_server=True, prefix=f"ns-{uuid.uuid4().hex[:8]}", timeout_s=120) as store, \
            Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=120) as pub:
        pub.add("w", w, layout)
        pub.export()
        try:
            child = Child(["receiver", store.address, store.prefix, store.secret, str(NUMEL), sync], hostname="wl-elsewhere")
            ready = child.expect("ready")
            assert ready["ok"] and ready["version"] == 1
            # Another host name and pid table: only its lock can tell whether it lives.
            assert ready["hostname"] == "wl-elsewhere" != socket.gethostname()
            assert ready["ns_pid"] != ready["host_pid"] and ready["token"]

            pub.begin_update(timeout_s=120)
            w.add_(1.0)
            assert pub.publish() == 2
            child.send("pull")
            child.expect("pulling")
            assert (protocol.reader_count(store, 0, 2), _board_held(pub)) == ((0, True) if sync == "board" else (1, False))
            os.kill(ready["host_pid"], signal.SIGKILL)  # mid-pull, inside version 2

            pub.begin_update(timeout_s=120)  # lets the dead reader go instead of timing out
            assert protocol.reader_count(store, 0, 2) == 0
            w.mul_(3.0)
            assert pub.publish() == 3

            target = torch.zeros(NUMEL, dtype=torch.float32)
            rec = Receiver(store, num_publishers=1, backend="shm", install="copy", timeout_s=120)
            rec.add("w", layout, target)
            assert rec.refit().version == 3
            assert torch.equal(target, (torch.arange(NUMEL, dtype=torch.float32) + 1.0) * 3.0)  # bit-exact

            wait_dead(ready["token"], ready["ns_pid"])
            arenas.reap_orphaned_shm()  # its receive buffers and lock go with it
            assert _files(ready["prefix"]) == []
        finally:
            if rec is not None:
                rec.close()
            if child is not None:
                child.close(timeout_s=30)


def test_reaper_leaves_a_live_peer_in_another_pid_namespace_alone() -> None:
    pid = free_pid()  # the peer gets this pid in its namespace; here, no process has it
    if pid is None:
        pytest.skip("no free pid in this namespace")
    child = Child(["arena"], hostname="wl-container", last_pid=pid - 1)
    try:
        ready = child.expect("ready")
        assert ready["ns_pid"] != ready["host_pid"]
        if liveness.pid_alive(ready["ns_pid"]):
            pytest.skip(f"pid {ready['ns_pid']} was taken here meanwhile; the case needs it free")
        path = os.path.join(arenas.SHM_DIR, ready["name"])

        arenas.reap_orphaned_shm()
        assert os.path.exists(path), "the reaper removed a live peer's arena"
        with open(path, "rb") as f:
            assert f.read(4096) == b"\x5a" * 4096
        assert liveness.token_alive(ready["token"], pid=ready["ns_pid"]) is True

        os.kill(ready["host_pid"], signal.SIGKILL)
        wait_dead(ready["token"], ready["ns_pid"])
        arenas.reap_orphaned_shm()
        assert _files(ready["prefix"]) == []
    finally:
        child.close(timeout_s=30)


def test_a_live_publisher_in_another_pid_namespace_under_this_hostname_is_refit_from() -> None:
    """A publisher in a PID namespace of its own under this host's name (a container with
    ``--ipc=host --uts=host``): its pid names no process here, its process lock (the token its
    manifest's board carries) says it lives, and refits install its version bit-exact."""
    pid = free_pid()  # the publisher gets this pid in its namespace; here, no process has it
    if pid is None:
        pytest.skip("no free pid in this namespace")
    with Store("127.0.0.1", 0, is_server=True, prefix=f"nspub-{uuid.uuid4().hex[:8]}", timeout_s=120) as store:
        child = Child(["publisher", store.address, store.prefix, store.secret, str(NUMEL)],
                      hostname=socket.gethostname(), last_pid=pid - 1)
        rec = None
        try:
            ready = child.expect("ready")
            assert ready["ns_pid"] != ready["host_pid"] and ready["hostname"] == socket.gethostname()
            if liveness.pid_alive(ready["ns_pid"]):
                pytest.skip(f"pid {ready['ns_pid']} was taken here meanwhile; the case needs it free")
            target = torch.zeros(NUMEL, dtype=torch.float32)
            rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=120)
            rec.add("w", TensorLayout.plain("w", "float32", (NUMEL,)), target)
            for _ in range(2):  # the first cycle and a warm one
                target.zero_()
                assert rec.refit().version == 1
                assert torch.equal(target, torch.arange(NUMEL, dtype=torch.float32))
        finally:
            if rec is not None:
                rec.close()
            child.close(timeout_s=30)
