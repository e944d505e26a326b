"""Receiver.stream over shm in one process: buckets through a bounded buffer, handed to a loader
while later buckets still move, only the rows a loader keeps pulled, fail closed mid-stream."""

from __future__ import annotations

import pytest
import torch

from _harness import TIMEOUT_S, new_store

from warmlink.errors import ConfigError, TransferTimeout
from warmlink.refit import Publisher, Receiver
from warmlink.refit.manifest import Part, Shard, TensorLayout
from warmlink.refit.receiver import PartialLoadError

NUM, ROWS, COLS = 8, 64, 32  # eight float32 tensors of 8 KiB each


def _full(i: int, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * version + i)
    return torch.randn(ROWS, COLS, generator=g)


class _Job:
    """Two publishers, each holding half the rows of every tensor (TP 2, dim 0)."""

    def __init__(self) -> None:
        self.store = new_store()
        self.pubs, self.held = [], []
        for rank in range(2):
            pub = Publisher(self.store, rank=rank, world_size=2, backend="shm", timeout_s=TIMEOUT_S)
            held = {}
            for i in range(NUM):
                lay = TensorLayout.plain(f"w{i}", "float32", (ROWS, COLS), 0, 2, rank)
                held[f"w{i}"] = _full(i, 1).chunk(2)[rank].clone()
                pub.add(f"w{i}", held[f"w{i}"], lay)
            pub.export()
            self.pubs.append(pub)
            self.held.append(held)

    def step(self, version: int) -> None:
        for rank, pub in enumerate(self.pubs):
            with pub.update():
                for i in range(NUM):
                    self.held[rank][f"w{i}"].copy_(_full(i, version).chunk(2)[rank])

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()
        self.store.close()


@pytest.fixture
def job():
    j = _Job()
    yield j
    j.close()


def _receiver(job, layouts) -> Receiver:
    rec = Receiver(job.store, num_publishers=2, backend="shm", timeout_s=TIMEOUT_S)
    for lay in layouts:
        rec.add(lay.name, lay)
    return rec


def _whole() -> list[TensorLayout]:
    return [TensorLayout.plain(f"w{i}", "float32", (ROWS, COLS)) for i in range(NUM)]


def test_buckets_reach_the_loader_while_later_ones_move_and_memory_stays_bounded(job):
    model_bytes = NUM * ROWS * COLS * 4
    got = {}

    def load_weights(weights):
        for name, t in weights:
            got[name] = t.clone()

    with _receiver(job, _whole()) as rec:
        for version in (1, 2):
            if version == 2:
                job.step(2)
            got.clear()
            rep = rec.stream(load_weights, buffer_bytes=model_bytes // 2)
            assert rep.version == version
            assert sorted(got) == sorted(f"w{i}" for i in range(NUM))
            assert all(torch.equal(got[f"w{i}"], _full(i, version)) for i in range(NUM))
            assert rep.num_buckets >= 3 and rep.peak_buffer_bytes <= model_bytes // 2
            # the first bucket was handed over before the last one's pull was even issued,
            # and each next pull was issued before the bucket before it was handed over
            assert rep.handed_at_s[0] < rep.issued_at_s[-1]
            assert all(rep.issued_at_s[b + 1] < rep.handed_at_s[b] for b in range(rep.num_buckets - 1))
        assert rep.created == {"arena": 0, "registration": 0, "peer_mapping": 0, "plan": 0}  # the second is warm


def test_a_rank_pulls_only_the_rows_its_loader_keeps():
    """Full-shape tensors with one box as parts: only those rows move; the rest hands over as zeros."""
    store = new_store()
    try:
        full = _full(0, 1)
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
        pub.add("w0", full.clone(), TensorLayout.plain("w0", "float32", (ROWS, COLS)))
        pub.export()
        kept = Shard((ROWS, COLS), ((16, 48), (0, COLS)))
        lay = TensorLayout("w0", "float32", (Part("w0", kept, (16, 0)),), (ROWS, COLS))
        got = {}
        with Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S) as rec:
            rec.add("w0", lay)
            rep = rec.stream(lambda ws: got.update((n, t.clone()) for n, t in ws), buffer_bytes=1 << 16)
        want = torch.zeros_like(full)
        want[16:48] = full[16:48]
        assert torch.equal(got["w0"], want)
        assert rep.nbytes == 32 * COLS * 4 and rep.handed_nbytes == ROWS * COLS * 4
        pub.close()
    finally:
        store.close()


def test_groups_stay_in_one_call_and_a_buffer_too_small_is_refused_before_any_byte_moves(job):
    calls = []
    groups = [["w0", "w5"], ["w1", "w2", "w3"]]
    with _receiver(job, _whole()) as rec:
        rec.stream(lambda ws: calls.append([n for n, _ in ws]), buffer_bytes=6 * ROWS * COLS * 4, groups=groups)
        for g in groups:
            assert any(set(g) <= set(c) for c in calls), (g, calls)
        with pytest.raises(ConfigError, match="buffer_bytes >= "):
            rec.stream(lambda ws: pytest.fail("handed"), buffer_bytes=2 * ROWS * COLS * 4, groups=groups)


def test_a_failure_after_the_first_bucket_is_a_partial_load_naming_what_was_taken(job):
    calls = []

    def load_weights(weights):
        calls.append([n for n, _ in weights])
        if len(calls) == 2:
            raise RuntimeError("loader broke")

    with _receiver(job, _whole()) as rec:
        with pytest.raises(PartialLoadError, match="mix of versions") as info:
            rec.stream(load_weights, buffer_bytes=NUM * ROWS * COLS * 4 // 2)
        assert info.value.bucket_idx == 1 and info.value.handed == calls[0] + calls[1]
        assert isinstance(info.value.__cause__, RuntimeError)
        # the receiver left the version: the publishers update, and the next stream is whole
        job.step(2)
        got = {}
        rec.stream(lambda ws: got.update((n, t.clone()) for n, t in ws), buffer_bytes=NUM * ROWS * COLS * 4 // 2)
        assert all(torch.equal(got[f"w{i}"], _full(i, 2)) for i in range(NUM))


def test_a_version_that_never_completes_fails_before_the_loader_is_called(job):
    job.pubs[1].begin_update()  # rank 1 updating: no version all publishers agree on
    with _receiver(job, _whole()) as rec:
        with pytest.raises(TransferTimeout):
            rec.stream(lambda ws: pytest.fail("handed"), buffer_bytes=1 << 20, timeout_s=0.5)
    job.pubs[1].publish()
