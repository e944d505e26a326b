"""NixlLink on GPU memory (issue 5): two processes on two GPUs (one when the machine has one),
VRAM moved by UCX. Bit-exact READ and WRITE, notifications, nothing registered after the first
cycle, and memory that UCX may not map by CUDA IPC (expandable segments) never silently slow.
Runs on the device machine; skipped without CUDA or nixl-cu13."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.transport._child import Child

pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install warmlink[nixl])")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from warmlink import pool
from warmlink.errors import SlowTransportWarning
from warmlink.transport.base import Copy, PeerRef
from warmlink.transport.nixl import DEFAULT_MIN_GBPS, SPEED_CHECK_BYTES, NixlLink

NBYTES = 256 << 20


def _pattern(n: int, salt: int, device) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64, device=device) * 13 + salt) % 251).to(torch.uint8)


def _peer_main(control, results, device: int, expandable: bool, ucx_threads: int | None = None) -> None:
    """A GPU peer: one allocated region and one registered torch tensor, both filled."""
    try:
        if expandable:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        torch.cuda.set_device(device)
        from warmlink.transport.base import local_identity

        link = NixlLink(device, timeout_s=30, ucx_threads=ucx_threads)
        arena = link.allocate(NBYTES)
        arena.tensor.copy_(_pattern(NBYTES, 1, device))
        plain = torch.empty(NBYTES, dtype=torch.uint8, device=device)
        plain.copy_(_pattern(NBYTES, 2, device))
        registered = link.register(plain)
        torch.cuda.synchronize()
        regions = [arena, registered]
        results.put({"descs": [dict(r.desc) for r in regions], "identity": local_identity()})
        while True:
            msg = control.get(timeout=120)
            if msg is None:
                break
            if msg[0] == "notification":
                results.put(link.wait_notification(msg[1], timeout_s=30))
            else:  # a digest of the region: sum of bytes and a strided sample
                t = regions[msg[1]].tensor
                results.put([int(t.sum(dtype=torch.int64)), t[:: 1 << 16].cpu().tolist()])
        for r in regions:
            link.release(r)
        link.close()
    except BaseException as exc:  # noqa: BLE001  reported, never hangs the parent
        results.put({"error": repr(exc)})


def _devices() -> tuple[int, int]:
    return 0, (1 if torch.cuda.device_count() > 1 else 0)


def _digest(t: torch.Tensor) -> list:
    return [int(t.sum(dtype=torch.int64)), t[:: 1 << 16].cpu().tolist()]


def _push_and_check(link: NixlLink, child: Child, copies: list, region_idx: int, expect: torch.Tensor) -> None:
    """WRITE ``copies`` with a notification; the child names this link's agent as its sender and
    its region ``region_idx`` then holds ``expect``."""
    torch.cuda.synchronize()
    link.write(link.prepare(copies), notify=b"pushed").wait(30)
    child.control.put(("notification", b"pushed"))
    assert child.get() == link.agent_name
    child.control.put(("digest", region_idx))
    assert child.get() == _digest(expect)


def test_vram_read_write_notify_and_warm_cycles():
    here, there = _devices()
    child = Child(_peer_main, there, False)
    pool.set_enabled(True)
    link = NixlLink(here, timeout_s=30)
    try:
        info = child.get(timeout=120)
        peer = PeerRef("gpu/0", 1, *info["identity"])
        remotes = [link.open(peer, d) for d in info["descs"]]
        assert all(d["mem"] == "VRAM" and d["device"] == there for d in info["descs"])
        local = link.allocate(2 * NBYTES)
        batch = link.prepare([Copy(local, 0, remotes[0], 0, NBYTES), Copy(local, NBYTES, remotes[1], 0, NBYTES)])
        created = []
        for cycle in range(3):
            before = pool.stats().get("registration", {}).get("created", 0)
            local.tensor.zero_()
            torch.cuda.synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("error", SlowTransportWarning)  # plain cudaMalloc memory is never slow
                link.read(batch).wait(30)
            created.append(pool.stats().get("registration", {}).get("created", 0) - before)
            assert torch.equal(local.tensor[:NBYTES], _pattern(NBYTES, 1, here))
            assert torch.equal(local.tensor[NBYTES:], _pattern(NBYTES, 2, here))
        assert created[1:] == [0, 0], created

        src = link.register(_pattern(NBYTES, 7, here))
        _push_and_check(link, child, [Copy(src, 0, remotes[1], 0, NBYTES)], 1, _pattern(NBYTES, 7, here))
    finally:
        link.close()
        child.stop()
        pool.set_enabled(None)


def test_ucx_threads_split_vram_batches_bit_exact():
    """Note [UCX threads]: a 64-descriptor batch split across 4 UCX threads, READ and WRITE with
    a notification, lands exactly; the repost of the split request too."""
    here, there = _devices()
    child = Child(_peer_main, there, False, 4)
    link = NixlLink(here, timeout_s=30, ucx_threads=4)
    try:
        info = child.get(timeout=120)
        arena = link.open(PeerRef("gpu/2", 1, *info["identity"]), info["descs"][0])
        rows, n = 64, NBYTES // 64
        local = link.allocate(NBYTES)
        batch = link.prepare([Copy(local, n * i, arena, n * (rows - 1 - i), n) for i in range(rows)])
        expect = _pattern(NBYTES, 1, here).view(rows, n).flip(0).reshape(-1)
        for _ in range(2):
            local.tensor.zero_()
            torch.cuda.synchronize()
            link.read(batch).wait(30)
            assert torch.equal(local.tensor, expect)
        local.tensor.copy_(_pattern(NBYTES, 9, here))
        _push_and_check(link, child, [Copy(local, n * i, arena, n * i, n) for i in range(rows)], 0,
                        _pattern(NBYTES, 9, here))
    finally:
        link.close()
        child.stop()


def test_expandable_segments_memory_is_fast_or_reported():
    """UCX may not map cuMemCreate memory by CUDA IPC: then the first big transfer must warn."""
    here, there = _devices()
    child = Child(_peer_main, there, True)
    link = NixlLink(here, timeout_s=60)
    try:
        info = child.get(timeout=120)
        peer = PeerRef("gpu/1", 1, *info["identity"])
        remote = link.open(peer, info["descs"][1])  # the torch tensor, in an expandable segment
        local = link.allocate(NBYTES)
        batch = link.prepare([Copy(local, 0, remote, 0, NBYTES)])
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            transfer = link.read(batch)
            transfer.wait(60)
        slow = [w for w in got if issubclass(w.category, SlowTransportWarning)]
        gbps = NBYTES / max(1e-9, link._agent.duration_s(batch.prepared.groups[0][5]["READ"]) or 1e-9) / 1e9
        print(f"expandable-segments VRAM read: {gbps:.1f} GB/s, warned: {bool(slow)}")
        assert NBYTES >= SPEED_CHECK_BYTES
        assert gbps >= DEFAULT_MIN_GBPS or slow, f"{gbps:.2f} GB/s and no SlowTransportWarning"
        assert torch.equal(local.tensor, _pattern(NBYTES, 2, here))
    finally:
        link.close()
        child.stop()
