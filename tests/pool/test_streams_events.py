"""Stream and event pools: reset before reuse, config in the key, pool on/off, thread safety.

CPU tests replace ``warmlink._cuda``'s stream/event calls with fakes (the pool calls them through
the module); GPU tests use real CUDA streams and skip without a device.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from warmlink import _cuda, pool
from warmlink.pool import events, streams
from warmlink.pool.core import stats

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _delta(kind: str, before: dict) -> dict:
    now = stats().get(kind, {})
    return {k: now.get(k, 0) - before.get(kind, {}).get(k, 0) for k in ("created", "reused", "destroyed", "failed_resets")}


@pytest.fixture
def clean_pools():
    streams.clear_idle()
    events.clear_idle()
    pool.set_enabled(True)
    yield
    pool.set_enabled(None)
    streams.clear_idle()
    events.clear_idle()


# -- CPU: fakes -----------------------------------------------------------------------------------
class FakeCuda:
    """Stand-ins for the _cuda calls the pools make; ``busy[h]`` = queries left before idle."""

    def __init__(self) -> None:
        self.ids = itertools.count(0x1000)
        self.live: set[int] = set()
        self.busy: dict[int, int] = {}
        self.broken: set[int] = set()

    def create(self, device, priority_or_timing=0):
        h = next(self.ids)
        self.live.add(h)
        return h

    def query(self, h):
        if h in self.broken:
            raise _cuda.TransferError(f"cudaStreamQuery({h:#x}) failed: cudaErrorIllegalAddress (700)")
        left = self.busy.get(h, 0)
        if left > 0:
            self.busy[h] = left - 1
            return False
        return True

    def destroy(self, h, device=None):
        self.live.remove(h)


@pytest.fixture
def fake(monkeypatch, clean_pools):
    f = FakeCuda()
    monkeypatch.setattr(_cuda, "stream_create", f.create)
    monkeypatch.setattr(_cuda, "stream_query", f.query)
    monkeypatch.setattr(_cuda, "stream_destroy", f.destroy)
    monkeypatch.setattr(_cuda, "stream_priority_range", lambda device: (0, -5))
    monkeypatch.setattr(_cuda, "event_create", f.create)
    monkeypatch.setattr(_cuda, "event_query", f.query)
    monkeypatch.setattr(_cuda, "event_destroy", f.destroy)
    monkeypatch.setattr(streams, "DRAIN_TIMEOUT_S", 0.05)
    yield f
    streams.clear_idle()  # while the fakes are still patched: no fake handle outlives the test
    events.clear_idle()


def test_fake_reuse_and_drain(fake):
    before = stats()
    with streams.lease_stream(0) as s:
        h = s.handle
        fake.busy[h] = 3  # three queries busy, then idle: drained, then reused
    with streams.lease_stream(0) as s2:
        assert s2.handle == h
        assert fake.busy[h] == 0
    d = _delta("stream", before)
    assert (d["created"], d["reused"], d["failed_resets"]) == (1, 1, 0)


def test_an_urgent_stream_has_the_greatest_priority_and_a_pool_of_its_own(fake):
    with streams.lease_urgent_stream(0) as urgent, streams.lease_stream(0) as plain:
        assert (urgent.priority, plain.priority) == (-5, 0)
        h = urgent.handle
    with streams.lease_stream(0) as plain:  # a released urgent stream is never handed out as a plain one
        assert plain.handle != h
    with streams.lease_urgent_stream(0) as urgent:
        assert urgent.handle == h


def test_fake_stuck_stream_destroyed(fake):
    before = stats()
    lease = streams.lease_stream(0)
    h = lease.resource.handle
    fake.busy[h] = 10**9  # never drains within DRAIN_TIMEOUT_S
    lease.release()
    assert h not in fake.live
    with streams.lease_stream(0) as s:
        assert s.handle != h
    d = _delta("stream", before)
    assert d["failed_resets"] == 1 and d["destroyed"] == 1


def test_fake_error_stream_destroyed(fake):
    before = stats()
    lease = streams.lease_stream(0, priority=-1)
    fake.broken.add(lease.resource.handle)
    lease.release()
    assert lease.resource.handle not in fake.live
    assert _delta("stream", before)["failed_resets"] == 1


def test_fake_priority_in_key_and_range(fake):
    with streams.lease_stream(0, 0) as a:
        pass
    with streams.lease_stream(0, -1) as b:
        assert b.handle != a.handle
    with pytest.raises(streams.ConfigError, match="priority"):
        streams.lease_stream(0, 1)
    with pytest.raises(streams.ConfigError, match="device"):
        streams.lease_stream(-1)


def test_fake_pool_off_creates_each_time(fake):
    pool.set_enabled(False)
    before = stats()
    for _ in range(3):
        with streams.lease_stream(0):
            pass
        with events.lease_event(0):
            pass
    assert _delta("stream", before)["created"] == 3 and _delta("stream", before)["destroyed"] == 3
    assert _delta("event", before)["created"] == 3 and _delta("event", before)["destroyed"] == 3
    assert not fake.live


def test_fake_event_timing_in_key_and_pending_destroyed(fake):
    before = stats()
    with events.lease_event(0, timing=False) as a:
        pass
    with events.lease_event(0, timing=True) as b:
        assert b.handle != a.handle
    lease = events.lease_event(0)
    assert lease.resource.handle == a.handle
    fake.busy[a.handle] = 10**9
    lease.release()
    assert a.handle not in fake.live
    assert _delta("event", before)["failed_resets"] == 1


def test_wait_until_bounded():
    t0 = time.perf_counter()
    assert streams.wait_until(lambda: False, 0.05) is False
    assert time.perf_counter() - t0 < 1.0
    assert streams.wait_until(lambda: True, 0.0) is True


# -- GPU ------------------------------------------------------------------------------------------
@gpu
@needs_cuda
def test_gpu_lease_release_reuses_handle(clean_pools):
    with streams.lease_stream(0) as s:
        h = s.handle
        assert s.torch_stream().cuda_stream == h
    with streams.lease_stream(0) as s2:
        assert s2.handle == h
    with events.lease_event(0) as e:
        eh = e.handle
    with events.lease_event(0) as e2:
        assert e2.handle == eh


@gpu
@needs_cuda
def test_gpu_queued_work_drained_before_reuse(clean_pools):
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    lease = streams.lease_stream(0)
    h = lease.resource.handle
    for _ in range(8):  # ~8 GiB of device copies: milliseconds of queued work
        _cuda.memcpy_async(dst.data_ptr(), src.data_ptr(), nbytes, h)
    lease.release()
    with streams.lease_stream(0) as s:
        assert s.handle == h
        assert _cuda.stream_query(h), "a reused stream must be idle"
    del src, dst


@gpu
@needs_cuda
def test_gpu_priority_mismatch_never_reuses(clean_pools):
    least, greatest = _cuda.stream_priority_range(0)
    if least == greatest:
        pytest.skip("device has a single stream priority")
    with streams.lease_stream(0, least) as a:
        pass
    with streams.lease_stream(0, greatest) as b:
        assert b.handle != a.handle and b.priority == greatest


@gpu
@needs_cuda
def test_gpu_pool_off_creates_and_destroys(clean_pools):
    pool.set_enabled(False)
    before = stats()
    handles = []
    for _ in range(3):
        with streams.lease_stream(0) as s:
            handles.append(s.handle)
    d = _delta("stream", before)
    assert d["created"] == 3 and d["destroyed"] == 3 and d["reused"] == 0


@gpu
@needs_cuda
def test_gpu_concurrent_leases_exclusive(clean_pools):
    held: set[int] = set()
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        try:
            for _ in range(50):
                with streams.lease_stream(0) as s:
                    with lock:
                        if s.handle in held:
                            errors.append(f"stream {s.handle:#x} handed to two holders")
                        held.add(s.handle)
                    time.sleep(0.0005)
                    with lock:
                        held.discard(s.handle)
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
