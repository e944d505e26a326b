"""Refit's calls end within their timeout while the store's server is stopped (SIGSTOP): the
publisher's and receiver's deadlines reach every store round trip (Note [Store deadlines] in
warmlink.rendezvous.store). A call that blocks past its timeout plus ``MARGIN_S`` fails its test
at once (tests/_stalled.py)."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch
import torch.distributed  # noqa: F401 - its first import takes seconds: before any timed call

from tests._stalled import stoppable_server, times_out
from warmlink.refit import Publisher, Receiver
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGSTOP and /proc: Linux")

LIMIT_S = 1.0
W = TensorLayout.plain("w", "float32", (64, 32))


@pytest.fixture(scope="module")
def server():
    with stoppable_server("stall-refit") as s:
        yield s


@pytest.fixture
def store(server):
    """A fresh prefix per test, and a store default (60 s) far past LIMIT_S."""
    with Store.connect(server.address, prefix=f"{server.prefix}/{uuid.uuid4().hex[:8]}", timeout_s=60,
                       secret=server.secret) as s:
        yield s


def _publisher(store: Store) -> Publisher:
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=LIMIT_S)
    pub.add("w", torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32), W)
    return pub


def _receiver(store: Store) -> Receiver:
    rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=60)
    rec.add("w", W, torch.zeros(64, 32))
    return rec


def _times_out(fn) -> None:
    times_out(fn, LIMIT_S)


def test_export_raises_within_its_timeout(server, store: Store) -> None:
    _publisher(store).close()  # the link and its pool are warm: only the store's time is measured
    pub = _publisher(store)
    try:
        with server.stopped():
            _times_out(pub.export)
    finally:
        pub.close()


def test_begin_update_raises_within_its_timeout(server, store: Store) -> None:
    with _publisher(store) as pub:
        pub.export()
        with server.stopped():
            _times_out(lambda: pub.begin_update(timeout_s=LIMIT_S))


def test_publish_raises_within_its_timeout(server, store: Store) -> None:
    with _publisher(store) as pub:
        pub.export()
        pub.begin_update()
        with server.stopped():
            _times_out(pub.publish)


@pytest.mark.parametrize("warm", [False, True], ids=["first", "warm"])
def test_refit_raises_within_its_timeout(server, store: Store, store_sync, warm: bool) -> None:
    with _publisher(store) as pub, _receiver(store) as rec:
        pub.export()
        if warm:
            rec.refit(timeout_s=30)
        with server.stopped():
            _times_out(lambda: rec.refit(timeout_s=LIMIT_S))
        report = rec.refit(timeout_s=30)  # the store answers again: the next cycle runs
        assert report.version == 1


def test_warm_refit_on_this_host_needs_no_store(server, store: Store) -> None:
    """A receiver sharing the publisher's /dev/shm syncs on its version board: a warm cycle makes
    no store call, so a stopped store neither stops nor delays it."""
    with _publisher(store) as pub, _receiver(store) as rec:
        pub.export()
        rec.refit(timeout_s=30)
        with server.stopped():
            report = rec.refit(timeout_s=LIMIT_S)
            assert report.version == 1 and report.sync_s < LIMIT_S
            assert torch.equal(rec.tensors()["w"], torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32))


def test_start_refit_raises_within_its_timeout(server, store: Store, store_sync) -> None:
    with _publisher(store) as pub, _receiver(store) as rec:
        pub.export()
        rec.refit(timeout_s=30)
        with server.stopped():
            _times_out(lambda: rec.start_refit(timeout_s=LIMIT_S))
