"""Tests of warmlink.bench.nccl_refit: the gloo/CPU variant here, the NCCL one on >= 2 GPUs."""

from __future__ import annotations

import pytest

from warmlink.bench.nccl_refit import _bucket_layout, _fill_pattern, run_nccl_refit
from warmlink.errors import ConfigError, LayoutError, TransferTimeout

# Odd sizes, every dtype family, a 0-d and an empty tensor; a few KB in all.
SPEC = [
    ("layers.0.qkv.weight", (24, 40), "bfloat16"),
    ("layers.0.norm.weight", (33,), "float32"),
    ("layers.0.mask", (1000,), "bool"),
    ("step", (), "int64"),
    ("empty", (0, 8), "float16"),
    ("lm_head.weight", (3, 5, 7), "uint8"),
    ("scale_fp8", (301,), "float8_e4m3fn"),
]
PHASES = ("alloc_s", "pack_s", "transfer_s", "unpack_s", "total_s")


def _check_record(rec: dict, mode: str, backend: str, cycles: int) -> None:
    assert rec["mode"] == mode and rec["backend"] == backend
    assert rec["correct"] is True, rec["mismatched"]
    assert rec["mismatched"] == []
    assert rec["num_tensors"] == len(SPEC)
    assert rec["bytes"] == 24 * 40 * 2 + 33 * 4 + 1000 + 8 + 0 + 105 + 301
    assert rec["init_s"] > 0 and rec["first_collective_s"] > 0
    assert rec["group_init_s"] == pytest.approx(rec["init_s"] + rec["first_collective_s"])
    assert [c["cycle"] for c in rec["cycles"]] == list(range(1, cycles + 1))
    for c in rec["cycles"]:
        assert set(PHASES) <= set(c)
        assert c["total_s"] > 0 and c["transfer_s"] > 0
        assert c["total_s"] >= c["transfer_s"]
        assert all(c[p] >= 0 for p in PHASES)


def test_per_tensor_gloo():
    rec = run_nccl_refit(SPEC, mode="per_tensor", cycles=3, devices=(-1, -1), backend="gloo", timeout_s=60)
    _check_record(rec, "per_tensor", "gloo", 3)
    assert all(c["pack_s"] == 0 and c["unpack_s"] == 0 and c["alloc_s"] == 0 for c in rec["cycles"])


def test_bucket_gloo_allocates_once():
    rec = run_nccl_refit(
        SPEC, mode="bucket", bucket_nbytes=1024, cycles=3, devices=(-1, -1), backend="gloo", timeout_s=60
    )
    _check_record(rec, "bucket", "gloo", 3)
    assert rec["bucket_nbytes"] == 1024 and rec["num_buckets"] >= 3
    assert rec["cycles"][0]["alloc_s"] > 0
    assert all(c["alloc_s"] == 0 for c in rec["cycles"][1:])
    assert all(c["pack_s"] > 0 and c["unpack_s"] > 0 for c in rec["cycles"])


def test_child_failure_raises_with_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 \(inference\) failed:(.|\n)*injected fault"):
        run_nccl_refit(
            SPEC[:2], mode="per_tensor", cycles=1, devices=(-1, -1), backend="gloo", timeout_s=60,
            _fault={"rank": 1, "kind": "raise"},
        )


def test_child_death_raises():
    with pytest.raises(RuntimeError, match=r"rank 0 \(trainer\) exited with code 3"):
        run_nccl_refit(
            SPEC[:2], mode="per_tensor", cycles=1, devices=(-1, -1), backend="gloo", timeout_s=60,
            _fault={"rank": 0, "kind": "exit"},
        )


def test_hang_times_out():
    with pytest.raises(TransferTimeout, match="reported no result within timeout_s"):
        run_nccl_refit(
            SPEC[:2], mode="per_tensor", cycles=1, devices=(-1, -1), backend="gloo", timeout_s=5,
            _fault={"rank": 1, "kind": "hang"},
        )


@pytest.mark.parametrize(
    "kwargs, err",
    [
        ({"mode": "allgather"}, ConfigError),
        ({"mode": "bucket", "backend": "mpi"}, ConfigError),
        ({"mode": "bucket", "cycles": 0}, ConfigError),
        ({"mode": "bucket", "bucket_nbytes": 16}, ConfigError),
        ({"mode": "bucket", "devices": (0, 0)}, ConfigError),
        ({"mode": "bucket", "devices": (-1, -1)}, ConfigError),  # nccl needs GPUs
        ({"mode": "bucket", "timeout_s": 0}, ConfigError),
    ],
)
def test_bad_arguments_fail_before_spawning(kwargs, err):
    with pytest.raises(err):
        run_nccl_refit(SPEC, **kwargs)


@pytest.mark.parametrize(
    "spec",
    [
        [],
        [("a", (2,), "bfloat16"), ("a", (2,), "bfloat16")],
        [("a", (2, -1), "bfloat16")],
        [("a", (2,), "complex32")],
        [("a", (2,))],
    ],
)
def test_bad_spec_is_a_layout_error(spec):
    with pytest.raises(LayoutError):
        run_nccl_refit(spec, mode="per_tensor", devices=(-1, -1), backend="gloo")


def test_bucket_layout_packs_aligned_and_splits_oversize():
    sizes, places = _bucket_layout([100, 200, 5000, 700, 10], 1024)
    assert places[0] == (0, 0) and places[1] == (0, 256)
    assert places[2] == (1, 0) and sizes[1] == 5000  # oversize tensor: a bucket of its own
    assert places[3] == (2, 0)  # 512 + 700 > 1024: new bucket
    assert places[4] == (2, 768)
    assert sizes == [456, 5000, 778]
    assert all(off % 256 == 0 for _b, off in places)


def test_fill_pattern_is_deterministic_and_seed_dependent():
    import torch

    a, b, c = (torch.empty(3000, dtype=torch.uint8) for _ in range(3))
    _fill_pattern(a, 7, False)
    _fill_pattern(b, 7, False)
    _fill_pattern(c, 8, False)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(torch.unique(a)) > 200  # every byte value shows up
    m = torch.empty(3000, dtype=torch.uint8)
    _fill_pattern(m, 7, True)
    assert set(torch.unique(m).tolist()) == {0, 1}


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


@pytest.mark.multigpu
@pytest.mark.skipif(_cuda_count() < 2, reason="needs at least 2 CUDA devices")
@pytest.mark.parametrize("mode", ["per_tensor", "bucket"])
def test_nccl_two_gpus(mode):
    spec = SPEC + [(f"big.{i}", (1024, 1024 + i), "bfloat16") for i in range(6)]
    rec = run_nccl_refit(
        spec, mode=mode, bucket_nbytes=4 << 20, cycles=3, devices=(0, 1), backend="nccl", timeout_s=120
    )
    assert rec["correct"] is True, rec["mismatched"]
    assert rec["backend"] == "nccl" and len(rec["cycles"]) == 3
    assert all(c["total_s"] > 0 and c["transfer_s"] > 0 for c in rec["cycles"])
    if mode == "bucket":
        assert rec["num_buckets"] >= 3 and rec["cycles"][1]["alloc_s"] == 0


def test_a_flipped_bit_is_reported():
    rec = run_nccl_refit(
        SPEC[:3], mode="bucket", cycles=2, devices=(-1, -1), backend="gloo", timeout_s=60,
        _fault={"rank": 0, "kind": "corrupt"},
    )
    assert rec["correct"] is False and rec["mismatched"] == [SPEC[0][0]]
