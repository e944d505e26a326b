"""Refit between processes over the nixl backend (issue 5): bit-exact across versions, and cycles
after the first register and create nothing; fan-out among engine replicas over it too. On host
memory in CI; on two GPUs (VRAM, UCX's cuda_ipc) on the device machine."""

from __future__ import annotations

import math
import time
import zlib

import pytest
import torch

pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install warmlink[nixl])")

from tests.ep._group import run_ranks

SHAPES = {"w0": (256, 128), "w1": (64, 64), "w2": (1024,), "w3": (8, 16, 32)}
VERSIONS = 3


def _values(name: str, version: int, shape, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{version}".encode()))  # same in every process
    return torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)


def _rank(rank: int, num_ranks: int, store, devices=("cpu", "cpu")) -> object:
    from warmlink.refit import Publisher, Receiver
    from warmlink.refit.manifest import TensorLayout

    layouts = {n: TensorLayout.plain(n, "bfloat16", s) for n, s in SHAPES.items()}
    if rank == 0:
        with Publisher(store, rank=0, world_size=1, backend="nixl", timeout_s=30) as pub:
            tensors = {n: _values(n, 1, s, devices[0]) for n, s in SHAPES.items()}
            for n, t in tensors.items():
                pub.add(n, t, layouts[n])
            pub.export()
            for version in range(2, VERSIONS + 1):
                store.get(f"pulled/{version - 1}", timeout_s=60)
                with pub.update(timeout_s=30):
                    for n, t in tensors.items():
                        t.copy_(_values(n, version, SHAPES[n], devices[0]))
            store.get(f"pulled/{VERSIONS}", timeout_s=60)
        return "published"
    targets = {n: torch.zeros(s, dtype=torch.bfloat16, device=devices[1]) for n, s in SHAPES.items()}
    reports = []
    with Receiver(store, num_publishers=1, backend="nixl", timeout_s=30) as rec:
        for n, t in targets.items():
            rec.add(n, layouts[n], t)
        for version in range(1, VERSIONS + 1):
            report = rec.refit(version=version, timeout_s=30)
            exact = all(torch.equal(targets[n].cpu().view(torch.int16), _values(n, version, SHAPES[n]).view(torch.int16))
                        for n in SHAPES)
            reports.append({"version": report.version, "exact": exact, "created": dict(report.as_dict()["created"])})
            store.set(f"pulled/{version}", b"1")
    return reports


def _check(reports) -> None:
    assert [r["version"] for r in reports] == list(range(1, VERSIONS + 1))
    assert all(r["exact"] for r in reports), reports
    assert reports[0]["created"].get("registration", 0) >= 1
    for r in reports[1:]:
        assert not any(r["created"].values()), r  # no registration, mapping, arena or plan after cycle 1


def test_refit_over_nixl_is_bit_exact_and_warm_after_the_first_cycle():
    _, reports = run_ranks(_rank, 2, timeout_s=120, prefix="refit-nixl")
    _check(reports)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refit_over_nixl_on_gpus_is_bit_exact_and_warm_after_the_first_cycle():
    devices = ("cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    _, reports = run_ranks(_rank, 2, timeout_s=150, prefix="refit-nixl-gpu", devices=devices)
    _check(reports)


FANOUT_ENGINES = 3


def _fanout_rank(rank: int, num_ranks: int, store) -> object:
    """Rank 0 publishes VERSIONS versions, each once every engine pulled the one before; ranks 1..3
    are engine replicas with fan-out (Note [Fan-out] in refit._relay), all over NIXL."""
    from warmlink.refit import FanOut, Publisher, Receiver
    from warmlink.refit.manifest import TensorLayout

    layouts = {n: TensorLayout.plain(n, "bfloat16", s) for n, s in SHAPES.items()}
    engines = num_ranks - 1

    def wait_pulled(version: int) -> None:
        deadline = time.monotonic() + 60
        while store.add(f"pulled/{version}", 0) < engines:
            assert time.monotonic() < deadline, f"engines did not pull version {version}"
            time.sleep(0.01)

    if rank == 0:
        with Publisher(store, rank=0, world_size=1, backend="nixl", timeout_s=30) as pub:
            tensors = {n: _values(n, 1, s) for n, s in SHAPES.items()}
            for n, t in tensors.items():
                pub.add(n, t, layouts[n])
            pub.export()
            for version in range(2, VERSIONS + 1):
                wait_pulled(version - 1)
                with pub.update(timeout_s=30):
                    for n, t in tensors.items():
                        t.copy_(_values(n, version, SHAPES[n]))
            wait_pulled(VERSIONS)
        return "published"
    targets = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    reports = []
    with Receiver(store, num_publishers=1, backend="nixl", timeout_s=30,
                  fanout=FanOut("nixl-engines", chunk_bytes=8 << 10, stall_s=20)) as rec:
        for n, t in targets.items():
            rec.add(n, layouts[n], t)
        for version in range(1, VERSIONS + 1):
            report = rec.refit(version=version, timeout_s=30)
            exact = all(torch.equal(targets[n].view(torch.int16), _values(n, version, SHAPES[n]).view(torch.int16))
                        for n in SHAPES)
            reports.append({"version": report.version, "exact": exact, "replica": report.replica,
                            "pulled_from": dict(report.pulled_from), "created": dict(report.created)})
            store.add(f"pulled/{version}", 1)
        wait_pulled(VERSIONS)  # a relay that closed early would be routed around by the replicas after it
    return reports


def test_fanout_over_nixl_sends_each_version_from_the_trainer_once():
    """Three engine processes over NIXL (UCX on host memory): each version bit-exact everywhere,
    the trainer's bytes those of one model, every replica's from its parent: on one host a star
    around the first (Note [Fan-out tree])."""
    model_nbytes = sum(2 * math.prod(s) for s in SHAPES.values())
    _, *engines = run_ranks(_fanout_rank, 1 + FANOUT_ENGINES, timeout_s=180, prefix="refit-nixl-fanout")
    for version in range(1, VERSIONS + 1):
        got = [reports[version - 1] for reports in engines]
        assert all(g["version"] == version and g["exact"] for g in got), got
        assert sum(g["pulled_from"].get("publishers", 0) for g in got) == model_nbytes, got
        assert {g["replica"]: list(g["pulled_from"]) for g in got} == {1: ["publishers"], 2: ["replica 1"], 3: ["replica 1"]}
    assert all(not any(reports[-1]["created"].values()) for reports in engines), engines
