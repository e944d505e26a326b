"""A receiver's caches and cycle ends on the shm backend (``refit._parked``, ``refit._cycle``).

Every cycle ends, however it fails: a store lost while counting out, a receiver closed mid-pull.
The memory a swap install points the model at is never handed to another user, even when a
publisher's new layout replaces the receiver's buffers. Faults are injected where they happen:
a store whose ``add`` raises, a pull that sleeps or breaks (``shm.fault_hook``).
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from warmlink import pool
from warmlink.bench.refit import build_physical
from warmlink.errors import PeerLostError, TransferError, VersionError
from warmlink.pool import lease_arena
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit._parked import release_parked
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm

W = TensorLayout.plain("w", "float32", (128, 64))  # 32 KiB: 8 chunks of 4 KiB
EXTRA = TensorLayout.plain("extra", "float32", (16,))
TIMEOUT_S = 10.0


@pytest.fixture(params=[True, False], ids=["pool_on", "pool_off"])
def pooling(request):
    pool.set_enabled(request.param)
    yield request.param
    release_parked()
    pool.set_enabled(None)


@pytest.fixture
def store():
    release_parked()
    with Store("127.0.0.1", 0, is_server=True, prefix=f"caches-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as s:
        yield s
    release_parked()


def _publisher(store, layouts: tuple = (W,), seed: int = 1) -> tuple[Publisher, dict]:
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
    tensors = {l.name: build_physical(l, "cpu", seed) for l in layouts}
    for l in layouts:
        pub.add(l.name, tensors[l.name], l)
    pub.export()
    return pub, tensors


def _receiver(store, **kw) -> tuple[Receiver, torch.Tensor]:
    rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S, **kw)
    target = torch.full(W.local_shape, -1.0)
    rec.add("w", W, target)
    return rec, target


class LostAtLeave:
    """Wraps ``store.add``: while armed, counting out of a version raises as a lost store does."""

    def __init__(self, monkeypatch, store) -> None:
        self.armed = False
        real = store.add

        def add(key, amount, **kwargs):
            if self.armed and "/readers/" in key and amount < 0:
                raise PeerLostError(f"Store.add: key={key!r}: store {store.address} is closed (injected)")
            return real(key, amount, **kwargs)

        monkeypatch.setattr(store, "add", add)


# -- a failed cycle never wedges the receiver ---------------------------------------------------------
@pytest.mark.parametrize("pull", ["arrives", "breaks"])
def test_store_lost_while_leaving_ends_the_cycle(store, pooling, store_sync, monkeypatch, pull: str) -> None:
    pub, tensors = _publisher(store)
    rec, target = _receiver(store)
    lost = LostAtLeave(monkeypatch, store)
    try:
        rec.refit(timeout_s=5)
        assert torch.equal(target, tensors["w"])
        with pub.update():
            tensors["w"].add_(1)
        old = target.clone()
        handle = rec.start_refit(version=2, timeout_s=5)
        if pull == "breaks":
            monkeypatch.setattr(shm, "fault_hook", lambda nbytes: (_ for _ in ()).throw(OSError("link went down")))
        lost.armed = True
        with pytest.raises(PeerLostError, match="injected"):
            handle.wait()
        lost.armed = False
        monkeypatch.setattr(shm, "fault_hook", None)
        assert torch.equal(target, old), "a failed cycle installed something"
        with pytest.raises(VersionError, match="cycle 2 failed"):
            handle.wait()  # the handle remembers: never a report for a cycle that did not install
        # The lost store op left this process's count inside version 2; it goes with the store.
        assert protocol.reader_count(store, 0, 2) == 1
        protocol.leave(store, 0, 2)

        report = rec.refit(timeout_s=5)  # not "a cycle is already in flight"
        assert report.version == 2 and torch.equal(target, tensors["w"])
        pub.begin_update(timeout_s=1)  # it left no reader count behind: no TransferTimeout
        pub.publish()
    finally:
        rec.close()
        pub.close()


def test_store_lost_while_leaving_a_failed_start(store, pooling, monkeypatch) -> None:
    """start_refit fails after entering (the publishers no longer have what was declared) and
    counting out fails too."""
    pub, _ = _publisher(store)
    rec, target = _receiver(store)
    lost = LostAtLeave(monkeypatch, store)
    try:
        rec.refit(timeout_s=5)
        pub.close()
        pub, _ = _publisher(store, (EXTRA,))
        lost.armed = True
        with pytest.raises(PeerLostError, match="injected"):
            rec.refit(timeout_s=5)
        lost.armed = False
        protocol.leave(store, 0, pub.version)  # the count the lost store op left
        pub.close()
        pub, tensors = _publisher(store, seed=3)
        rec.refit(timeout_s=5)
        assert torch.equal(target, tensors["w"])
    finally:
        rec.close()
        pub.close()


def test_close_mid_cycle_fails_the_cycle_and_leaves_its_version(store, pooling, monkeypatch) -> None:
    pub, tensors = _publisher(store)
    rec, target = _receiver(store)
    try:
        rec.refit(timeout_s=5)
        old = target.clone()
        with pub.update():
            tensors["w"].add_(1)
        monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
        monkeypatch.setattr(shm, "fault_hook", lambda nbytes: time.sleep(0.02))
        handle = rec.start_refit(version=2, timeout_s=5)
        rec.close()
        pub.begin_update(timeout_s=2)  # the closed receiver counted itself out: no TransferTimeout
        pub.publish()
        with pytest.raises(VersionError, match="receiver was closed"):
            handle.wait()
        assert torch.equal(target, old)
        monkeypatch.setattr(shm, "fault_hook", None)
        again, target = _receiver(store)
        with again:
            assert again.refit(timeout_s=5).version == 3 and torch.equal(target, tensors["w"])
    finally:
        monkeypatch.setattr(shm, "fault_hook", None)
        rec.close()
        pub.close()


# -- swap: the installed half is never given away ---------------------------------------------------
def test_swap_keeps_the_installed_buffers_when_a_new_layout_replaces_them(store, monkeypatch) -> None:
    """A publisher re-created with another manifest changes the plan's signature: the receiver
    makes new buffers, but the model points into the old ones until a new version is installed."""
    pool.set_enabled(True)
    pub, tensors = _publisher(store, seed=1)
    rec, target = _receiver(store, install="swap")
    try:
        rec.refit(timeout_s=5)
        installed = rec.tensors()["w"]
        assert torch.equal(installed, tensors["w"])
        pub.close()
        pub, tensors = _publisher(store, (W, EXTRA), seed=2)  # a new generation: a new signature

        def broken(nbytes: int) -> None:
            raise OSError("link went down")

        monkeypatch.setattr(shm, "fault_hook", broken)
        with pytest.raises(TransferError, match="link went down"):
            rec.refit(timeout_s=5)
        monkeypatch.setattr(shm, "fault_hook", None)
        # Take every idle arena the pool could hand out and scribble on it.
        leases = [lease_arena("shm", installed.untyped_storage().nbytes()) for _ in range(4)]
        for lease in leases:
            lease.resource.tensor.fill_(0xFF)
        for lease in leases:
            lease.release()
        assert torch.equal(target, build_physical(W, "cpu", 1)), "the installed version was handed to another user"
        rec.refit(timeout_s=5)
        assert torch.equal(target, tensors["w"])
    finally:
        monkeypatch.setattr(shm, "fault_hook", None)
        rec.close()
        pub.close()
        pool.set_enabled(None)
