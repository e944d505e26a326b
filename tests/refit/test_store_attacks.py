"""A network attacker without the secret against store-synced receivers (Note [Version header]).

The attacker is a plain ``TCPStore`` client of the job's store: it reads every value, writes back
any value the job ever signed (replays), moves values between keys, and adds to or overwrites
counters, which carry no MAC. The receivers here sync through the store, as receivers on another
host do (``store_sync``: no version board), and each trial uses a new receiver too (a first
cycle). What must hold: no receiver installs a torn or misplaced version, every refusal is a
typed error, and the trainer's next version installs everywhere. Content is a function of the
version, so "whole" is checked bit for bit against the version the receiver reports.
"""

from __future__ import annotations

import datetime
import threading
import uuid

import pytest
import torch

from warmlink.errors import MetadataError, TransferTimeout, VersionError
from warmlink.refit import PartialLoadError, Publisher, Receiver, protocol
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm

A = TensorLayout.plain("a", "float32", (128, 64))  # 32 KiB: 8 chunks of 4 KiB
B = TensorLayout.plain("b", "float32", (64, 32))


def content(layout: TensorLayout, version: int) -> torch.Tensor:
    """What tensor ``layout`` holds at ``version``: distinct per tensor, per element and per version."""
    n = layout.local_shape[0] * layout.local_shape[1]
    seed = 1000 * version + (1 if layout.name == "a" else 2)
    return (torch.arange(n, dtype=torch.float32) + seed * 1e5).view(layout.local_shape)


@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"attack-{uuid.uuid4().hex[:8]}", timeout_s=30) as s:
        yield s


def attacker(store: Store):
    """A client of the job's store with no secret: the job's keys as they are on the wire."""
    import torch.distributed as dist

    return dist.PrefixStore(store.prefix, dist.TCPStore(store.host, store.port, None, False,
                                                        timeout=datetime.timedelta(seconds=10)))


class Trainer:
    """A publisher in this process whose tensors hold ``content(layout, version)``."""

    def __init__(self, store: Store, layouts=(A, B)) -> None:
        self.layouts = layouts
        self.tensors = {lay.name: content(lay, 1) for lay in layouts}
        self.pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=30)
        for lay in layouts:
            self.pub.add(lay.name, self.tensors[lay.name], lay)
        self.pub.export()

    def write(self) -> None:
        """The trainer's step: the next version's content (call between begin_update and publish)."""
        for lay in self.layouts:
            self.tensors[lay.name].copy_(content(lay, self.pub.version + 1))

    def step(self) -> int:
        with self.pub.update(timeout_s=30):
            self.write()
        return self.pub.version

    def close(self) -> None:
        self.pub.close()


def receiver(store: Store, install: str = "copy") -> tuple[Receiver, dict]:
    targets = {lay.name: torch.full(lay.local_shape, -1.0) for lay in (A, B)}
    rec = Receiver(store, num_publishers=1, backend="shm", install=install, timeout_s=30)
    for lay in (A, B):
        rec.add(lay.name, lay, targets[lay.name])
    return rec, targets


def whole(targets: dict, version: int) -> bool:
    return all(torch.equal(t, content(lay, version)) for lay, t in zip((A, B), targets.values()))


def test_a_replayed_published_state_installs_the_present_version(store, store_sync) -> None:
    """The attacker writes back "published v1" (signed) after every update: each new receiver, and
    a warm one, installs the version the publisher has, whole (before: stuck at 1, torn)."""
    trainer, raw = Trainer(store), attacker(store)
    stale = raw.get("pub/0/state")
    warm, warm_targets = receiver(store)
    try:
        assert warm.refit().version == 1
        for _ in range(9):
            version = trainer.step()
            raw.set("pub/0/state", stale)
            rec, targets = receiver(store)
            with rec:
                assert rec.refit().version == version and whole(targets, version)
            assert warm.refit().version == version and whole(warm_targets, version)
    finally:
        warm.close()
        trainer.close()


def test_a_replayed_updating_state_holds_no_one_out(store, store_sync) -> None:
    trainer, raw = Trainer(store), attacker(store)
    try:
        trainer.pub.begin_update()
        updating = raw.get("pub/0/state")  # signed "updating 1"
        trainer.write()
        trainer.pub.publish()
        raw.set("pub/0/state", updating)
        rec, targets = receiver(store)
        with rec:
            assert rec.refit(timeout_s=10).version == 2 and whole(targets, 2)
    finally:
        trainer.close()


@pytest.mark.parametrize("install", ["copy", "direct"])
def test_forged_counts_and_replays_mid_pull_never_install_a_mix(store, store_sync, monkeypatch, install) -> None:
    """10 trials: a pull is held a quarter in while the attacker zeroes the reader counts, takes the
    slot count back to 0 and replays an old state; the trainer writes the moment ``begin_update``
    lets it. Every cycle installs one whole version or refuses (typed); the next one is whole."""
    trainer, raw = Trainer(store), attacker(store)
    stale = raw.get("pub/0/state")
    monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
    outcomes = {"whole": 0, "refused": 0, "let_in": 0}
    try:
        for trial in range(10):
            rec, targets = receiver(store, install)
            with rec:
                if trial % 2:
                    rec.refit()  # a warm receiver's cycle, then the held one
                midway, go_on, chunks = threading.Event(), threading.Event(), []

                def hold(nbytes: int) -> None:
                    chunks.append(nbytes)
                    if len(chunks) == 3:
                        midway.set()
                        assert go_on.wait(timeout=60), "the test never let the pull go on"

                monkeypatch.setattr(shm, "fault_hook", hold)
                handle = rec.start_refit()
                assert midway.wait(timeout=60), "the pull never started"
                version = trainer.pub.version
                slots = int(raw.add("pub/0/reader_slots", 0))
                for k in range(1, slots + 1):
                    raw.set(protocol.readers_key(0, version, k), "0")
                raw.set("pub/0/reader_slots", "0")
                raw.set("pub/0/state", stale)
                try:
                    trainer.pub.begin_update(timeout_s=0.5)
                    outcomes["let_in"] += 1
                    trainer.write()  # the trainer writes under the held pull
                    trainer.pub.publish()
                except (TransferTimeout, MetadataError):
                    pass
                go_on.set()
                try:
                    report = handle.wait()
                except (VersionError, PartialLoadError) as exc:
                    outcomes["refused"] += 1
                    assert "version header moved" in str(exc)
                else:
                    outcomes["whole"] += 1
                    assert whole(targets, report.version), f"trial {trial}: a torn install of version {report.version}"
                monkeypatch.setattr(shm, "fault_hook", None)
                latest = trainer.step()
                assert rec.refit().version == latest and whole(targets, latest)
    finally:
        trainer.close()
    print(f"{install}: {outcomes}")
    assert outcomes["let_in"] >= 1, outcomes  # the forgery did let the trainer in: the headers caught it
    assert outcomes["whole"] + outcomes["refused"] == 10, outcomes


def test_an_earlier_generation_replayed_over_reused_memory_installs_nothing_misplaced(store, store_sync) -> None:
    """The publisher is re-created in its process over the same (pooled) staging arena with its
    tensors in another order, so generation 1's offsets now hold other tensors; the attacker
    replays generation 1's signed state. No receiver installs from generation 1's offsets."""
    first, raw = Trainer(store), attacker(store)
    stale = raw.get("pub/0/state")
    first.close()
    second = Trainer(store, layouts=(B, A))
    try:
        assert second.pub.generation != 1
        for _ in range(3):
            raw.set("pub/0/state", stale)
            rec, targets = receiver(store)
            with rec:
                try:
                    report = rec.refit(timeout_s=3)
                except (TransferTimeout, MetadataError):
                    assert all(bool((t == -1).all()) for t in targets.values()), "a refused cycle touched the targets"
                else:
                    assert report.version == second.pub.version and whole(targets, report.version)
            second.step()
        rec, targets = receiver(store)  # the attacker stops: the next version installs
        with rec:
            assert rec.refit().version == second.pub.version and whole(targets, second.pub.version)
    finally:
        second.close()


def test_a_manifest_replayed_under_a_reused_generation_is_refused_naming_the_key(store, store_sync) -> None:
    """The attacker takes the generation counter back, so the re-created publisher reuses
    generation 1, then writes generation 1's earlier manifest back over it (its MAC is valid there):
    the version header's digest refuses it."""
    first, raw = Trainer(store), attacker(store)
    old_manifest = raw.get("pub/0/manifest/1")  # small: one value, not chunks (Note [Blobs] in rendezvous._blobs)
    first.close()
    raw.add("__generation__/pub/0", -1)
    second = Trainer(store, layouts=(B, A))
    try:
        assert second.pub.generation == 1
        raw.set("pub/0/manifest/1", old_manifest)
        rec, targets = receiver(store)
        with rec, pytest.raises(MetadataError, match=r"pub/0/manifest/1 is not the one its version header names"):
            rec.refit(timeout_s=5)
        assert all(bool((t == -1).all()) for t in targets.values())
    finally:
        second.close()


def test_a_garbage_counter_costs_the_attacker_the_key_not_the_trainer_its_connection(store, store_sync, caplog) -> None:
    trainer, raw = Trainer(store), attacker(store)
    try:
        rec, targets = receiver(store)
        with rec:
            assert rec.refit().version == 1
            slot = protocol.reader_slot(store, 0)
            raw.set(protocol.readers_key(0, 1, slot), "not a number")
            raw.set(protocol.beat_key(0, slot), "nor this")
            assert trainer.step() == 2  # its store connection lives on
            assert "is not a counter" in caplog.text
            assert rec.refit().version == 2 and whole(targets, 2)
            raw.set(protocol.readers_key(0, 2, slot), "garbage")  # under the receiver's next count: its own slot's key
            assert rec.refit(version=2).version == 2 and whole(targets, 2)
            assert "pub/0/readers/2/" in caplog.text
            assert trainer.step() == 3
            assert rec.refit().version == 3 and whole(targets, 3)
    finally:
        trainer.close()


def test_a_value_moved_to_another_key_is_refused_naming_it(store, store_sync) -> None:
    trainer, raw = Trainer(store), attacker(store)
    try:
        trainer.step()
        raw.set("pub/0/state", raw.get("pub/0/manifest/1"))  # a signed value, at another key
        rec, targets = receiver(store)
        with rec, pytest.raises(MetadataError, match=r"key='pub/0/state'.* fails its MAC"):
            rec.refit(timeout_s=5)
        assert all(bool((t == -1).all()) for t in targets.values())
    finally:
        trainer.close()
