"""The version board (Note [Version board] in warmlink.refit._board): local receivers and the
publisher exclude each other through the kernel's file locks, not through store values.

Publisher and receivers run in this process where a test can: flock locks belong to open files, so
two descriptors of one board exclude each other as two processes do. A dead publisher is a child
process killed for real. No wait here depends on timing: every timeout only bounds a wait whose
outcome the test has already made certain.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid

import pytest
import torch

from warmlink.bench.refit import build_physical
from warmlink.errors import MetadataError, TransferTimeout, VersionError
from warmlink.pool import arenas, liveness
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit._board import CLOSED, PUBLISHED, UPDATING, PublisherBoard, ReaderBoard
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm

W = TensorLayout.plain("w", "float32", (256, 64))  # 64 KiB: 16 chunks of 4 KiB


@pytest.fixture
def board():
    b = PublisherBoard()
    try:
        yield b
    finally:
        b.close()


def _reader(board: PublisherBoard) -> ReaderBoard:
    r = ReaderBoard.open(board.desc, os.getpid(), "publisher/0")
    assert r is not None
    return r


def test_a_reader_inside_holds_the_publisher_out_until_it_leaves(board) -> None:
    board.publish(7, 1, timeout_s=1)
    reader = _reader(board)
    try:
        assert reader.enter(7, None) == (True, 1, PUBLISHED)
        with pytest.raises(TransferTimeout, match="version 1 still has a reader on this host"):
            board.begin(1, timeout_s=0.05)
        # Updating: a new reader backs off even though the lock is still shared.
        other = _reader(board)
        assert other.enter(7, None) == (False, 1, UPDATING)
        reader.leave()
        board.begin(1, timeout_s=1)  # out: the exclusive lock is had at once
        assert other.enter(7, None) == (False, 1, UPDATING)  # the lock is refused now
        board.publish(7, 2, timeout_s=1)
        assert other.enter(7, 1) == (False, 2, PUBLISHED)  # asked for 1: not entered
        assert other.enter(7, 2) == (True, 2, PUBLISHED)
        other.leave()
        other.close()
    finally:
        reader.close()


def test_another_generation_or_a_withdrawn_board_sends_the_reader_to_the_store(board) -> None:
    board.publish(3, 5, timeout_s=1)
    reader = _reader(board)
    try:
        assert reader.enter(4, None) == (False, 5, CLOSED)
        board.withdraw(5, timeout_s=1)
        assert reader.enter(3, None) == (False, 5, CLOSED)
        board.publish(3, 1, timeout_s=1)  # taken back by a publisher re-created over the same memory
        assert reader.enter(3, None) == (True, 1, PUBLISHED)
        reader.leave()
    finally:
        reader.close()


def test_a_board_that_is_not_what_the_manifest_says_is_refused(board, tmp_path) -> None:
    desc = board.desc
    # Another host's (or another /dev/shm's) publisher: not checkable here, the store's counts.
    assert ReaderBoard.open({**desc, "token": "f" * 32 + "-1/" + desc["token"].split("/", 1)[1]}, os.getpid(), "p") is None
    with pytest.raises(MetadataError, match=r"board.name=.* expected an arena of the publisher's process"):
        ReaderBoard.open(desc, os.getpid() + 1, "publisher/0")
    tag = liveness.own_tag()
    link = f"{tag}-{900000 + os.getpid() % 1000}"
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * 64)
    os.symlink(target, os.path.join(arenas.SHM_DIR, link))
    try:
        with pytest.raises(MetadataError, match="cannot be opened"):
            ReaderBoard.open({**desc, "name": link}, os.getpid(), "publisher/0")
    finally:
        os.unlink(os.path.join(arenas.SHM_DIR, link))
    with open(os.path.join(arenas.SHM_DIR, link), "wb") as f:
        f.write(b"\1" * 64)
    try:
        with pytest.raises(MetadataError, match="holds no warmlink board"):
            ReaderBoard.open({**desc, "name": link}, os.getpid(), "publisher/0")
    finally:
        os.unlink(os.path.join(arenas.SHM_DIR, link))
    assert ReaderBoard.open({**desc, "name": f"{tag}-999999999"}, os.getpid(), "publisher/0") is None  # gone


_DEAD_PUBLISHER = """
import json, sys
from warmlink.refit._board import PublisherBoard
b = PublisherBoard()
b.publish(9, 4, timeout_s=5)
print(json.dumps(b.desc), flush=True)
sys.stdin.readline()
"""


def test_a_dead_publishers_board_sends_the_reader_to_the_store() -> None:
    child = subprocess.Popen([sys.executable, "-c", _DEAD_PUBLISHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        desc = json.loads(child.stdout.readline())
        reader = ReaderBoard.open(desc, child.pid, "publisher/0")
        assert reader is not None and reader.enter(9, None) == (True, 4, PUBLISHED)
        reader.leave()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        assert reader.enter(9, None) == (False, 4, CLOSED)  # its words still say "published"
        reader.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
        arenas.reap_orphaned_shm()


def _forge_the_store(store: Store, rank: int, version: int) -> None:
    """What anyone who reaches the store's port can do to the reader counts (Note [Reader slots]):
    counters carry no MAC; an identity without the job's secret fails its MAC when read."""
    import datetime

    import torch.distributed as dist

    raw = dist.PrefixStore(store.prefix, dist.TCPStore(store.host, store.port, None, False,
                                                       timeout=datetime.timedelta(seconds=10)))
    slots = int(raw.add(f"pub/{rank}/reader_slots", 0))
    for k in range(1, slots + 1):
        raw.set(f"pub/{rank}/reader_slot/{k}", "elsewhere:999999:1")  # a dead process's identity
        raw.add(protocol.readers_key(rank, version, k), -5)
    raw.set(f"pub/{rank}/reader_slots", "0")


def test_forged_reader_counts_never_let_an_update_in_mid_pull(monkeypatch) -> None:
    """20 versions: each pull is held mid-way while the store's reader counts and identities are
    forged; ``begin_update`` must still wait, and every install is one whole version."""
    layout = W
    w = build_physical(layout, "cpu", 1)
    monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
    with Store("127.0.0.1", 0, is_server=True, prefix=f"forge-{uuid.uuid4().hex[:8]}", timeout_s=30) as store:
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=30)
        pub.add("w", w, layout)
        pub.export()
        target = torch.zeros(layout.shape)
        rec = Receiver(store, num_publishers=1, backend="shm", install="copy", timeout_s=30)
        rec.add("w", layout, target)
        torn = let_in = 0
        try:
            rec.refit()  # the first cycle reads the manifest (and opens the board) through the store
            for trial in range(20):
                published = w.clone()
                midway, go_on = threading.Event(), threading.Event()
                chunks: list[int] = []

                def hold(nbytes: int) -> None:
                    chunks.append(nbytes)
                    if len(chunks) == 4:  # a quarter of the bytes landed
                        midway.set()
                        assert go_on.wait(timeout=60), "the test never let the pull go on"

                monkeypatch.setattr(shm, "fault_hook", hold)
                handle = rec.start_refit()
                assert midway.wait(timeout=60), "the pull never started"
                _forge_the_store(store, 0, pub.version)
                try:  # a trainer: it writes the moment begin_update lets it
                    pub.begin_update(timeout_s=0.05)
                    let_in += 1
                    w.add_(1000.0)
                    pub.publish()
                except (TransferTimeout, MetadataError):  # either way it never returned: nothing written
                    pass
                go_on.set()
                report = handle.wait()
                monkeypatch.setattr(shm, "fault_hook", None)
                torn += not torch.equal(target, published)
                assert report.version == trial + 1
                pub.begin_update(timeout_s=5)  # the reader left: the update goes in
                w.add_(float(trial + 1))
                pub.publish()
        finally:
            rec.close()
            pub.close()
        assert (let_in, torn) == (0, 0)


def test_a_forged_huge_reader_slot_count_is_refused_not_walked() -> None:
    """A count of reader processes past any real one (anyone reaching the store can write it) makes
    begin_update raise MetadataError at once, naming the key, instead of walking 2**40 slots."""
    import datetime

    import torch.distributed as dist

    with Store("127.0.0.1", 0, is_server=True, prefix=f"slots-{uuid.uuid4().hex[:8]}", timeout_s=30) as store:
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=30)
        pub.add("w", torch.zeros(4), TensorLayout.plain("w", "float32", (4,)))
        pub.export()
        try:
            raw = dist.PrefixStore(store.prefix, dist.TCPStore(store.host, store.port, None, False,
                                                               timeout=datetime.timedelta(seconds=10)))
            raw.add("pub/0/reader_slots", 1 << 40)
            with pytest.raises(MetadataError, match=r"'pub/0/reader_slots'=1099511627776 out of range"):
                pub.begin_update(timeout_s=30)
        finally:
            pub.close()  # keeps its memory (readers elsewhere cannot be ruled out), raises nothing


@pytest.mark.parametrize("install", ["copy", "direct"])
def test_a_stalled_reader_on_another_host_is_revoked_and_installs_nothing(monkeypatch, store_sync, install) -> None:
    """Note [Reader leases]: a receiver that syncs through the store and stops beating (a stalled
    process on another host: its heartbeat thread held back here) is revoked after LEASE_S; the
    trainer writes while its pull is still under way, and when the pull ends the receiver refuses
    to install what it read (direct install: PartialLoadError, installed_version None)."""
    from warmlink.refit import PartialLoadError

    monkeypatch.setattr(protocol, "LEASE_S", 0.3)
    monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
    layout = W
    w = build_physical(layout, "cpu", 1)
    with Store("127.0.0.1", 0, is_server=True, prefix=f"lease-{uuid.uuid4().hex[:8]}", timeout_s=30) as store:
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=30)
        pub.add("w", w, layout)
        pub.export()
        target = torch.zeros(layout.shape)
        rec = Receiver(store, num_publishers=1, backend="shm", install=install, timeout_s=30)
        rec.add("w", layout, target)
        try:
            rec.refit()
            installed = target.clone()
            monkeypatch.setattr(protocol._heart, "start", lambda *args: None)  # no heartbeat from here on
            midway, go_on = threading.Event(), threading.Event()
            chunks: list[int] = []

            def hold(nbytes: int) -> None:
                chunks.append(nbytes)
                if len(chunks) == 4:
                    midway.set()
                    assert go_on.wait(timeout=60), "the test never let the pull go on"

            monkeypatch.setattr(shm, "fault_hook", hold)
            handle = rec.start_refit()
            assert midway.wait(timeout=60), "the pull never started"
            pub.begin_update(timeout_s=30)  # revokes the silent reader after LEASE_S
            w.add_(1000.0)  # the trainer writes while that pull is still under way
            pub.publish()
            go_on.set()
            if install == "direct":
                with pytest.raises(PartialLoadError, match="version header moved from generation .* version 1 published"):
                    handle.wait()
                assert rec.installed_version is None
            else:
                with pytest.raises(VersionError, match="version header moved from generation .* version 1 published"):
                    handle.wait()
                assert torch.equal(target, installed), "a revoked pull installed something"
            monkeypatch.setattr(shm, "fault_hook", None)
            assert rec.refit().version == 2 and torch.equal(target, w)  # the next cycle is whole
        finally:
            rec.close()
            pub.close()


def test_a_forked_child_does_not_beat_for_its_parents_reads() -> None:
    """Note [Reader leases]: a child forked while its parent is inside a version starts inside
    nothing; beating for the parent's slot from the child would keep that read's lease alive after
    the parent died, and the publisher's next update would wait for a reader that is gone."""
    with Store("127.0.0.1", 0, is_server=True, prefix=f"fork-{uuid.uuid4().hex[:8]}", timeout_s=30) as store:
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=30)
        pub.add("w", torch.zeros(4), TensorLayout.plain("w", "float32", (4,)))
        pub.export()
        try:
            state = protocol.read_state(store, 0)
            protocol.count_in(store, 0, state.version)
            try:
                inside = protocol._heart.beating_for()
                assert inside == [(0, protocol.reader_slot(store, 0))]
                pid = os.fork()
                if pid == 0:  # the child: only pure Python, then out without running the parent's atexit
                    os._exit(0 if protocol._heart.beating_for() == [] else 1)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0, "the forked child inherited its parent's reads"
                assert protocol._heart.beating_for() == inside, "forking changed the parent's heartbeat"
            finally:
                protocol.leave(store, 0, state.version)
            assert protocol._heart.beating_for() == []
        finally:
            pub.close()
