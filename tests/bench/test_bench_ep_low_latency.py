"""``warmlink bench ep --low-latency`` end to end: CPU ranks over shm, and GPU ranks (gpu-marked)."""

from __future__ import annotations

import json

import pytest

from warmlink.bench.ep_low_latency import DEEPEP_LOW_LATENCY
from warmlink.cli.main import main


def test_bench_ep_low_latency_prints_each_call_beside_deepeps_figures(tmp_path, capsys):
    out = tmp_path / "ll.json"
    args = ["bench", "ep", "--low-latency", "--ranks", "2", "--tokens", "16", "--hidden", "256", "--experts", "8",
            "--topk", "4", "--iterations", "3", "--warmup", "1", "--timeout", "120", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    for row in ("dispatch (fp8)", "combine (bf16)", "dispatch, hook mode: send", "combine, hook mode: hook",
                "dispatch + combine, eager", "DeepEP docs/legacy.md",
                "DeepEP V1 in this run: not run (its kernels need CUDA)"):
        assert row in text, row
    assert "     8             77     98            114    127" in text  # EP 8, as DeepEP publishes it
    record = json.loads(out.read_text())
    assert record["deepep_published"]["rows"] == [list(r) for r in DEEPEP_LOW_LATENCY]
    for rank in record["ranks"]:
        assert all(len(times) == 3 and min(times) > 0 for times in rank["times_s"].values()), rank
        pairs = [d + c for d, c in zip(rank["times_s"]["dispatch"], rank["times_s"]["combine"])]
        assert rank["times_s"]["pair"] == pairs
    for op, row in record["summary"].items():
        assert 0 < row["median_us"] <= row["p90_us"], (op, row)


def test_bench_ep_low_latency_refuses_experts_that_do_not_divide(capsys):
    assert main(["bench", "ep", "--low-latency", "--ranks", "3", "--experts", "8"]) != 0
    assert "--experts=8 is not a multiple of --ranks=3" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_bench_ep_low_latency_times_the_device_path(tmp_path, capsys):
    out = tmp_path / "ll.json"
    args = ["bench", "ep", "--low-latency", "--ranks", "2", "--tokens", "32", "--hidden", "1024", "--experts", "16",
            "--iterations", "5", "--warmup", "2", "--timeout", "120", "--json", str(out)]
    assert main(args) == 0
    assert "cuda_ipc, CUDA events" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["config"]["device"] == "cuda"
    for op, row in record["summary"].items():
        assert 0 < row["median_us"] <= row["p90_us"], (op, row)
