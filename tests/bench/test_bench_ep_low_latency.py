"""``warmlink bench ep --low-latency`` end to end on CPU ranks over shm."""

from __future__ import annotations

import json

from warmlink.bench.ep_low_latency import DEEPEP_LOW_LATENCY
from warmlink.cli.main import main


def test_bench_ep_low_latency_prints_each_call_beside_deepeps_figures(tmp_path, capsys):
    out = tmp_path / "ll.json"
    args = ["bench", "ep", "--low-latency", "--ranks", "2", "--tokens", "16", "--hidden", "256", "--experts", "8",
            "--topk", "4", "--iterations", "3", "--warmup", "1", "--timeout", "120", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    for row in ("dispatch (fp8)", "combine (bf16)", "dispatch, hook mode: send", "combine, hook mode: hook",
                "DeepEP docs/legacy.md"):
        assert row in text, row
    assert "     8             77     98            114    127" in text  # EP 8, as DeepEP publishes it
    record = json.loads(out.read_text())
    assert record["deepep_published"]["rows"] == [list(r) for r in DEEPEP_LOW_LATENCY]
    for rank in record["ranks"]:
        assert all(len(times) == 3 and min(times) > 0 for times in rank["times_s"].values()), rank
    for op, row in record["summary"].items():
        assert 0 < row["median_us"] <= row["p90_us"], (op, row)


def test_bench_ep_low_latency_refuses_experts_that_do_not_divide(capsys):
    assert main(["bench", "ep", "--low-latency", "--ranks", "3", "--experts", "8"]) != 0
    assert "--experts=8 is not a multiple of --ranks=3" in capsys.readouterr().err
