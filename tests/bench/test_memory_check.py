"""Benches check host memory, /dev/shm and device memory before starting any process, and refuse
in one line (exit code 2) naming what they need and what is free."""

from __future__ import annotations

import pytest

from warmlink.bench import _memory
from warmlink.bench._memory import Need, shortfall
from warmlink.bench.lifecycle import memory_need as lifecycle_need
from warmlink.bench.model_spec import qwen3_4b_like
from warmlink.bench.reconfigure import memory_need as reconfigure_need
from warmlink.bench.refit import warmlink_refit_need
from warmlink.cli.main import main

GB = 10**9


def _free(host=100 * GB, shm=100 * GB, devices=None) -> dict:
    return {"host": host, "shm": shm, "devices": devices or {}}


def test_refusal_names_only_what_is_short() -> None:
    need = Need(host_bytes=30 * GB, shm_bytes=20 * GB, device_bytes={0: 10 * GB, 1: 50 * GB})
    assert shortfall(need, "lower it", _free(devices={0: 80 * GB, 1: 80 * GB})) is None
    line = shortfall(need, "lower it", _free(host=21 * GB, shm=12 * GB, devices={0: 80 * GB, 1: 40 * GB}))
    assert "\n" not in line and line.startswith("not enough memory to start: needs ")
    assert "30.0 GB of host memory (21.0 GB available)" in line and "20.0 GB in /dev/shm (12.0 GB free)" in line
    assert "50.0 GB on cuda:1 (40.0 GB free)" in line and "cuda:0" not in line and line.endswith("lower it")
    # What cannot be read is not checked (no /proc/meminfo, a device that could not be asked).
    assert shortfall(need, "h", {"host": None, "shm": None, "devices": {}}) is None


def test_needs_grow_with_the_bytes_and_the_install_mode() -> None:
    spec = qwen3_4b_like(1.0)
    cpu_copy = warmlink_refit_need(spec, src_tp=1, dst_tp=1, devices=(-1, -1), install="copy")
    cpu_swap = warmlink_refit_need(spec, src_tp=1, dst_tp=1, devices=(-1, -1), install="swap")
    # Staging plus one (copy) or two (swap) sets of receive buffers in /dev/shm.
    assert cpu_copy.shm_bytes == 2 * spec.nbytes and cpu_swap.shm_bytes == 3 * spec.nbytes
    assert cpu_swap.host_bytes > cpu_swap.shm_bytes + 2 * spec.nbytes  # both models, besides
    gpu = warmlink_refit_need(spec, src_tp=1, dst_tp=1, devices=(0, 1), install="swap")
    assert gpu.shm_bytes == 0 and gpu.device_bytes[1] > 3 * spec.nbytes > gpu.device_bytes[0] > spec.nbytes
    same = warmlink_refit_need(spec, src_tp=1, dst_tp=1, devices=(0, 0), install="swap")
    assert same.device_bytes[0] == gpu.device_bytes[0] + gpu.device_bytes[1]
    assert lifecycle_need(1 << 30, 1 << 20, (-1, -1), "copy").shm_bytes == 2 << 30
    both = reconfigure_need(1 << 30, 1 << 20, ("warm", "cold", "nccl"), (0, 1), "copy")
    assert both.device_bytes[0] > 3 << 30  # three staying processes hold the model at once


@pytest.mark.parametrize("argv", [
    ["bench", "lifecycle", "--tensors", "16", "--tensor-mib", "1e7", "--devices=-1,-1"],
    ["bench", "reconfigure", "--tensors", "16", "--tensor-mib", "1e7", "--devices=-1,-1", "--methods", "warm"],
])
def test_bench_that_cannot_fit_refuses_before_starting(argv, capsys) -> None:
    assert main(argv) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "not enough memory to start" in lines[0], out.err
    assert "of host memory (" in lines[0] and "in /dev/shm (" in lines[0]
    assert "lifecycles x" not in out.out and "repeats of" not in out.out  # nothing ran


def test_bench_refit_refuses_when_the_machine_is_short(monkeypatch, capsys) -> None:
    monkeypatch.setattr(_memory, "free_memory", lambda devices: _free(host=2 * GB, shm=1 * GB))
    assert main(["bench", "refit", "--scale", "0.5", "--devices=-1,-1", "--scenarios", "warm,nccl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("warmlink bench refit: not enough memory to start: needs ")
    assert "(2.0 GB available)" in err and "(1.0 GB free)" in err and "lower --scale" in err
