"""Receivers are not starved by a trainer that updates as fast as it can (Note [Reader line]).

The trainer here begins its next update the moment it published (no forward or backward pass in
between), the worst case for its receivers: without the line a receiver that was backing off while
the trainer wrote finds the next update begun whenever it looks. With it, a receiver that stands in
line when a version is published enters that version, so every refit ends within its bound, on
the version board and through the store, and every install is one whole version.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from _spawned import SpawnedWorker
from warmlink.refit import Publisher, Receiver
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store

W = TensorLayout.plain("w", "float32", (256, 64))  # 64 KiB


def content(version: int) -> torch.Tensor:
    """What ``w`` holds at ``version``: every element differs, and from every other version."""
    return (torch.arange(256 * 64, dtype=torch.float32) + version * 1e6).view(256, 64)


class BusyTrainer:
    """A publisher of ``w`` whose thread updates back to back until ``stop``."""

    def __init__(self, store: Store, **kwargs) -> None:
        self.tensor = content(1)
        self.pub = Publisher(store, backend="shm", timeout_s=120, **kwargs)
        self.pub.add("w", self.tensor, W)
        self.pub.export()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-trainer", daemon=True)

    def start(self) -> BusyTrainer:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self.pub.update(timeout_s=120):
                    self.tensor.copy_(content(self.pub.version + 1))
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=180)
        assert not self._thread.is_alive(), "the trainer's update never returned"
        self.pub.close()
        if self.error is not None:
            raise self.error
        return self.pub.version


def refit_loop(address: str, prefix: str, secret: str, num_receivers: int, cycles: int, bound_s: float,
               store_sync: bool) -> list[dict]:
    """``num_receivers`` receivers in threads of this process, each refitting ``cycles`` times
    with ``timeout_s=bound_s``; per receiver, what it saw."""
    if store_sync:
        from warmlink.refit import _board

        _board.ReaderBoard.open = classmethod(lambda cls, *args: None)
    store = Store.connect(address, prefix=prefix, secret=secret, timeout_s=120)
    results: list[dict] = [{} for _ in range(num_receivers)]
    start = threading.Barrier(num_receivers)

    def run(i: int) -> None:
        waits, versions, torn, errors = [], [], 0, []
        target = torch.zeros(256, 64)
        try:
            with Receiver(store, num_publishers=1, backend="shm", timeout_s=bound_s) as rec:
                rec.add("w", W, target)
                start.wait(timeout=120)
                for _ in range(cycles):
                    t0 = time.monotonic()
                    try:
                        version = rec.refit().version
                    except Exception as exc:  # noqa: BLE001 - counted, reported with its type
                        errors.append(f"{type(exc).__name__}: {exc}")
                        continue
                    waits.append(time.monotonic() - t0)
                    versions.append(version)
                    torn += not torch.equal(target, content(version))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
        results[i] = {"waits": waits, "versions": versions, "torn": torn, "errors": errors}

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num_receivers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=cycles * bound_s + 180)
    store.close()
    return results


def _line_worker(control, results, *args) -> None:
    import traceback

    while (msg := control.get()) is not None:
        try:
            results.put(("ok", refit_loop(*args)))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put(("error", traceback.format_exc()))
        del msg


@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"line-{uuid.uuid4().hex[:8]}", timeout_s=120) as s:
        yield s


@pytest.mark.parametrize("sync", ["board", "store"])
def test_a_receiver_in_line_enters_the_next_version_of_a_busy_trainer(store, sync, monkeypatch) -> None:
    """Four receivers of this process, 10 refits each, against a trainer updating back to back:
    each refit ends within its bound and installs a whole version."""
    if sync == "store":
        from warmlink.refit import _board

        monkeypatch.setattr(_board.ReaderBoard, "open", classmethod(lambda cls, *args: None))
    trainer = BusyTrainer(store).start()
    try:
        seen = refit_loop(store.address, store.prefix, store.secret, 4, 10, 30.0, sync == "store")
    finally:
        last = trainer.stop()
    for r in seen:
        assert r["errors"] == [] and r["torn"] == 0, r
        assert r["versions"] == sorted(r["versions"]) and r["versions"][-1] <= last
    assert len({v for r in seen for v in r["versions"]}) > 1  # the trainer did move on under them


@pytest.mark.parametrize("sync", ["board", "store"])
def test_200_receivers_against_one_busy_trainer_each_within_its_bound(store, sync) -> None:
    """200 receivers (4 processes of 50; on the version board after a first cycle through the
    store, or through the store throughout as on another host), 5 refits each with a bound of 60 s,
    on two cores busy with the trainer and each other: no refit times out, none installs a torn
    version. (With ``line_wait_s=0`` and a bound of 10 s, 61 and 28 of the 1000 refits time out.)"""
    bound_s, cycles = 60.0, 5
    workers = [SpawnedWorker(_line_worker, store.address, store.prefix, store.secret, 50, cycles, bound_s, sync == "store")
               for _ in range(4)]
    trainer = None
    try:
        trainer = BusyTrainer(store).start()
        for w in workers:
            w.send("run")
        seen = [r for w in workers for r in w.result(timeout_s=cycles * bound_s + 300)]
    finally:
        last = trainer.stop() if trainer is not None else None
        for w in workers:
            w.stop()
    errors = [e for r in seen for e in r["errors"]]
    waits = sorted(x for r in seen for x in r["waits"])
    assert errors == [], f"{len(errors)} refits failed, first: {errors[:3]}"
    assert sum(r["torn"] for r in seen) == 0
    assert len(waits) == 200 * cycles and waits[-1] < bound_s
    assert max(v for r in seen for v in r["versions"]) <= last
    print(f"{sync}: 200 receivers x {cycles} refits against {last} versions: wait median {waits[len(waits) // 2]:.3f} s, "
          f"p99 {waits[int(len(waits) * 0.99)]:.3f} s, max {waits[-1]:.3f} s")
