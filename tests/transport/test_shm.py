"""Tests for warmlink.transport.shm: registration, opening another process's region, batches,
coalescing, peer generations, peer loss, timeouts and cancel. CPU only."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.transport._child import Child as _Child
from warmlink import pool
from warmlink.errors import (
    ConfigError,
    LayoutError,
    PeerLostError,
    TransferError,
    TransferTimeout,
)
from warmlink.pool import arenas
from warmlink.pool.peers import open_mappings
from warmlink.transport import shm
from warmlink.transport.base import Copy, PeerRef, local_identity
from warmlink.transport.shm import ShmLink

CHILD_NBYTES = 64 << 10


def _pattern(n: int, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + salt) % 251).to(torch.uint8)


# -- the other process ------------------------------------------------------------------------------
def _child_main(control, results, nbytes: int) -> None:
    """Allocate a region, fill it with a pattern, send its descriptor; dump it on request."""
    try:
        link = ShmLink(timeout_s=10)
        region = link.allocate(nbytes)
        region.tensor.copy_(_pattern(nbytes, salt=1))
        host, pid, start = local_identity()
        results.put({"desc": dict(region.desc), "host": host, "pid": pid, "start_time": start})
        while True:
            msg = control.get(timeout=60)
            if msg is None:
                break
            if msg == "dump":
                results.put(region.tensor.numpy().tobytes())
        link.release(region)
        link.close()
    except BaseException as exc:  # reported, never hangs the parent
        results.put({"error": repr(exc)})


class Child(_Child):
    def __init__(self, nbytes: int = CHILD_NBYTES) -> None:
        super().__init__(_child_main, nbytes)


@pytest.fixture(scope="module")
def children():
    """Both children start at once so that their imports overlap: one serves, one exits early."""
    pair = (Child(), Child(nbytes=4096))
    yield pair
    for c in pair:
        c.stop()


@pytest.fixture(scope="module")
def child(children):
    return children[0]


@pytest.fixture(scope="module")
def child_info(child):
    return child.get()


@pytest.fixture
def link():
    pool.set_enabled(True)
    with ShmLink(timeout_s=5) as lk:
        yield lk
    pool.set_enabled(None)


def _peer(info: dict, key: str = "child/0", generation: int = 1) -> PeerRef:
    return PeerRef(key, generation, info["host"], info["pid"], info["start_time"])


def _self_peer(key: str, generation: int = 1) -> PeerRef:
    host, pid, start = local_identity()
    return PeerRef(key, generation, host, pid, start)


# -- registration -----------------------------------------------------------------------------------
def test_register_in_arena_tensor(link: ShmLink) -> None:
    region = link.allocate(4096)
    try:
        t = region.tensor[512:1536].view(torch.float32)  # 256 floats inside the arena
        reg = link.register(t)
        assert reg.nbytes == 1024 and reg.ptr == t.data_ptr() and reg.device == -1
        assert reg.desc["kind"] == "shm" and reg.desc["name"] == region.desc["name"]
        assert reg.desc["offset"] == 512 and reg.desc["nbytes"] == 1024
        assert reg.tensor.dtype == torch.uint8 and reg.tensor.numel() == 1024
        link.release(reg)
        link.release(reg)  # twice is fine
    finally:
        link.release(region)
        link.release(region)


def test_register_plain_cpu_tensor_raises(link: ShmLink) -> None:
    with pytest.raises(LayoutError, match="not in shared memory"):
        link.register(torch.zeros(64))


def test_register_non_contiguous_raises(link: ShmLink) -> None:
    region = link.allocate(4096)
    try:
        t = region.tensor[:1024].view(torch.float32).view(16, 16).t()
        with pytest.raises(LayoutError, match="not contiguous"):
            link.register(t)
    finally:
        link.release(region)


def test_link_config_errors() -> None:
    with pytest.raises(ConfigError, match="device"):
        ShmLink(timeout_s=1, device=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        ShmLink(timeout_s=0)


# -- another process's memory -----------------------------------------------------------------------
def test_read_flat_and_strided_from_child(link: ShmLink, child_info: dict) -> None:
    remote = link.open(_peer(child_info), child_info["desc"])
    local = link.allocate(CHILD_NBYTES)
    try:
        expect = _pattern(CHILD_NBYTES, salt=1)
        local.tensor.zero_()
        copies = [
            Copy(local, 0, remote, 100, 1000),  # flat
            Copy(local, 4096, remote, 8192, 64, num_rows=10, local_pitch=64, remote_pitch=200),  # strided gather
        ]
        batch = link.prepare(copies)
        assert len(batch.flat) == 1 and len(batch.strided) == 1 and batch.nbytes == 1000 + 640
        link.read(batch).wait(5)
        got = local.tensor
        assert torch.equal(got[:1000], expect[100:1100])
        for i in range(10):
            assert torch.equal(got[4096 + 64 * i : 4096 + 64 * (i + 1)], expect[8192 + 200 * i : 8192 + 200 * i + 64])
        assert int(got[1000:4096].count_nonzero()) == 0 and int(got[4096 + 640 :].count_nonzero()) == 0
        # The batch replays: same bytes again after the local side is cleared.
        local.tensor.zero_()
        link.read(batch).wait(5)
        assert torch.equal(got[:1000], expect[100:1100])
    finally:
        link.close_region(remote)
        link.release(local)


def test_write_to_child_is_seen_by_child(link: ShmLink, child: Child, child_info: dict) -> None:
    remote = link.open(_peer(child_info), child_info["desc"])
    local = link.allocate(CHILD_NBYTES)
    try:
        src = _pattern(CHILD_NBYTES, salt=99)
        local.tensor.copy_(src)
        batch = link.prepare([
            Copy(local, 0, remote, 32768, 512),
            Copy(local, 1024, remote, 40000, 16, num_rows=4, local_pitch=16, remote_pitch=100),
            Copy(local, 2048, remote, 50000, 8, num_rows=3, local_pitch=32, remote_pitch=8),
        ])
        link.write(batch).wait(5)
        child.control.put("dump")
        seen = torch.frombuffer(bytearray(child.get()), dtype=torch.uint8)
        expect = _pattern(CHILD_NBYTES, salt=1).clone()
        expect[32768 : 32768 + 512] = src[:512]
        for i in range(4):
            expect[40000 + 100 * i : 40000 + 100 * i + 16] = src[1024 + 16 * i : 1024 + 16 * (i + 1)]
        expect[50000 : 50000 + 24] = torch.cat([src[2048 + 32 * i : 2048 + 32 * i + 8] for i in range(3)])
        assert torch.equal(seen, expect)
    finally:
        link.close_region(remote)
        link.release(local)


def test_open_out_of_file_raises(link: ShmLink, child_info: dict) -> None:
    desc = dict(child_info["desc"], offset=CHILD_NBYTES * 64, nbytes=16)  # beyond the 2 MiB file
    with pytest.raises(LayoutError, match="file size"):
        link.open(_peer(child_info, generation=7), desc)


def test_child_exit_removes_file_and_open_raises_peer_lost(link: ShmLink, children) -> None:
    c = children[1]
    try:
        info = c.get()
    finally:
        c.stop()
    assert c.proc.exitcode == 0
    path = os.path.join(arenas.SHM_DIR, info["desc"]["name"])
    assert not os.path.exists(path), "a process that exits normally must not leave its shm files"
    peer = _peer(info, key="gone/0", generation=1)
    assert not peer.alive()
    with pytest.raises(PeerLostError, match="gone/0"):
        link.open(peer, info["desc"])


def test_open_removed_file_raises_peer_lost(link: ShmLink) -> None:
    with arenas.lease_arena("shm", 4096) as arena:
        desc = {"kind": "shm", "name": arena.name, "offset": 0, "nbytes": 4096}
        os.unlink(os.path.join(arenas.SHM_DIR, arena.name))
        try:
            with pytest.raises(PeerLostError, match="is gone"):
                link.open(_self_peer("removed/0"), desc)
        finally:
            arena.tensor = None  # its file is gone: never hand it out again (reset fails)


# -- batches ----------------------------------------------------------------------------------------
def _self_remote(link: ShmLink, key: str, nbytes: int = 8192, generation: int = 1):
    owner = link.allocate(nbytes)
    return owner, link.open(_self_peer(key, generation), owner.desc)


def test_coalescing_merges_adjacent(link: ShmLink) -> None:
    owner, remote = _self_remote(link, "coalesce/0")
    local = link.allocate(8192)
    try:
        owner.tensor.copy_(_pattern(8192, salt=3))
        pieces = [Copy(local, 100 * i, remote, 1000 + 100 * i, 100) for i in range(10)]
        batch = link.prepare(list(reversed(pieces)))  # order does not matter
        assert batch.num_copies == 1 and batch.num_requested == 10 and batch.nbytes == 1000
        assert batch.flat[0].local_offset == 0 and batch.flat[0].remote_offset == 1000
        # A 2-D copy with pitch == row size is really 1-D and joins its neighbours.
        batch2 = link.prepare([Copy(local, 0, remote, 0, 64, num_rows=4, local_pitch=64, remote_pitch=64),
                               Copy(local, 256, remote, 256, 32)])
        assert batch2.num_copies == 1 and not batch2.strided and batch2.nbytes == 288
        # Not adjacent on one side: no merge.
        batch3 = link.prepare([Copy(local, 0, remote, 0, 64), Copy(local, 64, remote, 128, 64)])
        assert batch3.num_copies == 2
        link.read(batch).wait(5)
        assert torch.equal(local.tensor[:1000], owner.tensor[1000:2000])
    finally:
        link.close_region(remote)
        link.release(owner)
        link.release(local)


def test_strided_copies_respect_region_offsets(link: ShmLink) -> None:
    """Regions that start inside their file (registered tensors, descriptors with offset > 0)."""
    owner = link.allocate(8192)
    local_owner = link.allocate(8192)
    try:
        owner.tensor.copy_(_pattern(8192, salt=9))
        desc = dict(owner.desc, offset=3000, nbytes=4096)
        remote = link.open(_self_peer("offset/0"), desc)
        local = link.register(local_owner.tensor[1024:5120])  # a registered slice: view offset 1024
        assert local.desc["offset"] == 1024
        local_owner.tensor.zero_()
        link.read(link.prepare([Copy(local, 0, remote, 100, 16, num_rows=5, local_pitch=32, remote_pitch=64)])).wait(5)
        for i in range(5):
            got = local_owner.tensor[1024 + 32 * i : 1024 + 32 * i + 16]
            assert torch.equal(got, owner.tensor[3000 + 100 + 64 * i : 3000 + 100 + 64 * i + 16]), f"row {i}"
        local_owner.tensor[1024:5120].fill_(7)
        link.write(link.prepare([Copy(local, 0, remote, 200, 8, num_rows=3, local_pitch=8, remote_pitch=40)])).wait(5)
        for i in range(3):
            assert owner.tensor[3200 + 40 * i : 3200 + 40 * i + 8].tolist() == [7] * 8, f"row {i}"
        assert owner.tensor[:3000].equal(_pattern(8192, salt=9)[:3000])  # nothing before the region
        link.close_region(remote)
        link.release(local)
    finally:
        link.release(owner)
        link.release(local_owner)


def test_prepare_rejects_out_of_bounds(link: ShmLink) -> None:
    owner, remote = _self_remote(link, "bounds/0", 4096)
    local = link.allocate(4096)
    try:
        with pytest.raises(ConfigError, match=r"copies\[1\] local end"):
            link.prepare([Copy(local, 0, remote, 0, 16), Copy(local, 4090, remote, 0, 16)])
        with pytest.raises(ConfigError, match="remote end.*peer='bounds/0'"):
            link.prepare([Copy(local, 0, remote, 4000, 16, num_rows=2, local_pitch=16, remote_pitch=100)])
        with pytest.raises(ConfigError, match="moves 0 bytes"):
            link.prepare([Copy(local, 0, remote, 0, 0)])
        with pytest.raises(ConfigError, match="remote_offset=-1"):
            link.prepare([Copy(local, 0, remote, -1, 8)])
        with pytest.raises(ConfigError, match="rows would overlap"):
            link.prepare([Copy(local, 0, remote, 0, 16, num_rows=2, local_pitch=8, remote_pitch=16)])
    finally:
        link.close_region(remote)
        link.release(owner)
        link.release(local)


def _process_peer(key: str, generation: int, start_time: int) -> PeerRef:
    """A peer in a process of its own: this host and pid, but another start time."""
    host, pid, _ = local_identity()
    return PeerRef(key, generation, host, pid, start_time)


def test_mappings_follow_the_peer_process(link: ShmLink) -> None:
    owner = link.allocate(4096)
    other_owner = link.allocate(4096)
    try:
        # Generations 1 and 2 of one process share a mapping (an engine re-created in place).
        r1 = link.open(_process_peer("forget/0", 1, 111), owner.desc)
        r2 = link.open(_process_peer("forget/0", 2, 111), owner.desc)
        # Another process in the same slot gets its own.
        r3 = link.open(_process_peer("forget/0", 3, 222), owner.desc)
        r_other = link.open(_process_peer("forget/1", 1, 111), other_owner.desc)
        cache = shm._mappings

        def slots():
            return {(k[0], k[1].rsplit(":", 1)[1]) for k in cache.keys() if k[0].startswith("forget/")}

        assert slots() == {("forget/0", "111"), ("forget/0", "222"), ("forget/1", "111")}
        n_before = open_mappings()
        assert link.forget_peer("forget/0", keep_process=r3.peer.process_id) == 1
        assert slots() == {("forget/0", "222"), ("forget/1", "111")}
        assert open_mappings() == n_before - 1
        # The evicted mapping is still held by r1 and r2: it keeps working until they close it.
        owner.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert r1.tensor[:4].tolist() == [1, 2, 3, 4] and r2.tensor[:4].tolist() == [1, 2, 3, 4]
        for r in (r1, r1, r2):
            link.close_region(r)
        # Regions the kept process no longer exports are closed too.
        assert link.forget_peer("forget/0", keep_process=r3.peer.process_id, keep_regions={"not-this-one"}) == 1
        assert slots() == {("forget/1", "111")}
        link.close_region(r3)
        link.close_region(r_other)
        assert link.forget_peer("forget/1") == 1
    finally:
        link.release(owner)
        link.release(other_owner)


# -- waiting, timeouts, cancel ----------------------------------------------------------------------
def _wait_done(transfer, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not transfer.done():
        assert time.monotonic() < deadline, "transfer never finished"
        time.sleep(0.01)


def test_wait_timeout_raises_transfer_timeout(link: ShmLink, monkeypatch) -> None:
    owner, remote = _self_remote(link, "timeout/0")
    local = link.allocate(8192)
    try:
        monkeypatch.setattr(shm, "fault_hook", lambda n: time.sleep(0.3))
        transfer = link.read(link.prepare([Copy(local, 0, remote, 0, 8192)]))
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="not done after"):
            transfer.wait(0.05)
        assert time.monotonic() - start < 1.0  # not the 0.3 s the hook sleeps per chunk
        _wait_done(transfer)
    finally:
        link.close_region(remote)
        link.release(owner)
        link.release(local)


def test_cancel_stops_between_chunks(link: ShmLink, monkeypatch) -> None:
    owner, remote = _self_remote(link, "cancel/0", 8192)
    local = link.allocate(8192)
    try:
        owner.tensor.fill_(5)
        local.tensor.zero_()
        monkeypatch.setattr(shm, "CHUNK_NBYTES", 1024)
        calls = []
        monkeypatch.setattr(shm, "fault_hook", lambda n: (calls.append(n), time.sleep(0.05)))
        transfer = link.read(link.prepare([Copy(local, 0, remote, 0, 8192)]))
        transfer.cancel()
        with pytest.raises(TransferError, match="cancelled"):
            transfer.wait(5)
        assert len(calls) <= 1
        assert int(local.tensor.count_nonzero()) <= 1024  # at most the chunk already under way
    finally:
        link.close_region(remote)
        link.release(owner)
        link.release(local)


def test_chunks_and_fault_hook_error(link: ShmLink, monkeypatch) -> None:
    owner, remote = _self_remote(link, "chunks/0", 8192)
    local = link.allocate(8192)
    try:
        owner.tensor.copy_(_pattern(8192, salt=5))
        monkeypatch.setattr(shm, "CHUNK_NBYTES", 1000)
        sizes = []
        monkeypatch.setattr(shm, "fault_hook", sizes.append)
        link.read(link.prepare([Copy(local, 0, remote, 0, 8192)])).wait(5)
        assert sizes == [1000] * 8 + [192] and torch.equal(local.tensor, owner.tensor)
        sizes.clear()
        link.read(link.prepare([Copy(local, 0, remote, 0, 300, num_rows=10, local_pitch=400, remote_pitch=500)])).wait(5)
        assert sizes == [900, 900, 900, 300]  # strided chunks hold whole rows

        def broken(n):
            raise OSError("injected")

        monkeypatch.setattr(shm, "fault_hook", broken)
        with pytest.raises(TransferError, match="injected"):
            link.read(link.prepare([Copy(local, 0, remote, 0, 64)])).wait(5)
    finally:
        link.close_region(remote)
        link.release(owner)
        link.release(local)


def test_closed_link_refuses_work() -> None:
    lk = ShmLink(timeout_s=2)
    owner = lk.allocate(4096)
    remote = lk.open(_self_peer("closed/0"), owner.desc)
    batch = lk.prepare([Copy(owner, 0, remote, 0, 16)])
    lk.close()
    lk.close()
    with pytest.raises(TransferError, match="closed"):
        lk.read(batch)
    lk.close_region(remote)
    lk.release(owner)
