"""Publisher.close withdraws its version before giving memory back (Note [Version protocol]): a
receiver arriving after the close waits instead of reading released memory, a reader still inside
keeps the memory alive, and a store already gone does not stop the close. CPU, shm backend."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import torch

from warmlink.errors import TransferTimeout
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store

SHAPES = {"w0": (64, 32), "w1": (128,)}


@pytest.fixture
def store():
    with Store(is_server=True, prefix=f"close-{uuid.uuid4().hex[:8]}", timeout_s=10) as s:
        yield s


def _publisher(store, timeout_s: float = 5.0) -> Publisher:
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=timeout_s)
    for i, (name, shape) in enumerate(SHAPES.items()):
        pub.add(name, torch.full(shape, float(i + 1), dtype=torch.bfloat16), TensorLayout.plain(name, "bfloat16", shape))
    pub.export()
    return pub


def _refit(store, timeout_s: float) -> dict:
    targets = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    with Receiver(store, num_publishers=1, backend="shm", timeout_s=timeout_s) as rec:
        for n, t in targets.items():
            rec.add(n, TensorLayout.plain(n, "bfloat16", SHAPES[n]), t)
        rec.refit(timeout_s=timeout_s)
    return targets


def test_receiver_after_close_waits_instead_of_reading_released_memory(store) -> None:
    pub = _publisher(store)
    got = _refit(store, 5.0)
    assert all(torch.equal(got[n], torch.full(s, float(i + 1), dtype=torch.bfloat16)) for i, (n, s) in enumerate(SHAPES.items()))
    pub.close()
    state = protocol.read_state(store, 0)
    assert (state.state, state.version) == ("updating", 1)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="did not agree on a published version"):
        _refit(store, 0.5)
    assert time.monotonic() - start < 5
    successor = _publisher(store)  # a successor publishes again, and receivers read it
    try:
        assert protocol.read_state(store, 0).state == "published"
        _refit(store, 5.0)
    finally:
        successor.close()


def test_reader_inside_keeps_the_memory(store, caplog) -> None:
    pub = _publisher(store, timeout_s=0.3)
    state = protocol.read_state(store, 0)
    protocol.count_in(store, 0, state.version)  # a live reader of this process, mid-pull
    try:
        with caplog.at_level(logging.WARNING, logger="warmlink.refit"):
            pub.close()
        assert "readers inside" in caplog.text
        assert pub._regions and pub._link is not None  # nothing given back while a peer may read it
        assert protocol.read_state(store, 0).state == "updating"
    finally:
        protocol.leave(store, 0, state.version)


def test_close_after_the_store_is_gone_still_releases() -> None:
    server = Store(is_server=True, prefix=f"gone-{uuid.uuid4().hex[:8]}", timeout_s=2)
    pub = _publisher(server)
    server.close()
    pub.close()  # no raise: nobody can enter through a store that is gone
    assert pub._link is None and not pub._regions


class _ManifestWriteFails:
    """The job's store, except that writing a manifest fails (a store-side error mid-export)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def set_blob(self, key, data, **kw):
        raise TransferTimeout(f"injected: writing {key!r} timed out")

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_close_after_a_failed_export_releases_and_raises_nothing() -> None:
    """An export that fails before announcing a version leaves nothing to withdraw: close() only
    gives the memory back (it used to write an 'updating' state of generation 0 and raise)."""
    with Store("127.0.0.1", 0, is_server=True, prefix=f"close-failed-{uuid.uuid4().hex[:8]}", timeout_s=30) as store:
        pub = Publisher(_ManifestWriteFails(store), rank=0, world_size=1, backend="shm", timeout_s=5)
        pub.add("a", torch.zeros(4))
        with pytest.raises(TransferTimeout, match="injected"):
            pub.export()
        pub.close()
        assert store.try_get(protocol.state_key(0)) is None
