"""``warmlink bench reconfigure`` on CPU: receiver processes replaced, beside a new gloo group (seed 001)."""

from __future__ import annotations

import json

from warmlink.cli.main import main

NEW_PROCESS = ("start_imports_s", "cuda_s", "model_s", "store_s", "connect_s", "pull_s", "refit_s", "total_s")


def test_bench_reconfigure_on_cpu(tmp_path, capsys):
    path = tmp_path / "reconfigure.json"
    rc = main(["bench", "reconfigure", "--repeats", "1", "--tensors", "3", "--tensor-mib", "0.0625", "--devices=-1,-1",
               "--json", str(path), "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    record = json.loads(path.read_text())
    assert record["bench"] == "reconfigure" and record["schema_version"] == 1 and record["repeats"] == 1
    assert set(record["methods"]) == {"warm", "cold", "nccl"}
    for method, res in record["methods"].items():
        assert res["correct"] is True, method
        (rep,) = res["repeats"]
        assert set(rep) == {"init", "reconfigure", "destroy", "cycle_s"}
        for stage in ("init", "reconfigure"):
            assert all(rep[stage][k] >= 0 for k in NEW_PROCESS), (method, stage, rep[stage])
            assert rep[stage]["start_imports_s"] > 0 and rep[stage]["total_s"] >= rep[stage]["refit_s"]
        reconf = rep["reconfigure"]
        assert reconf["exit_s"] > 0 and reconf["total_s"] >= reconf["exit_s"] + reconf["start_imports_s"]
        assert rep["destroy"]["total_s"] >= rep["destroy"]["close_s"] >= 0
        assert rep["cycle_s"] > reconf["total_s"]
        assert reconf["stayer"]["busy_s"] >= 0 and reconf["stayer"]["cpu_s"] >= 0
    for method in ("warm", "cold"):
        rep = record["methods"][method]["repeats"][0]
        # A fresh receiver process creates its resources; the staying publisher creates nothing.
        assert sum(rep["reconfigure"]["created"].values()) > 0
        assert all(v == 0 for v in rep["reconfigure"]["stayer"]["created"].values()), rep["reconfigure"]["stayer"]
        assert rep["reconfigure"]["stayer"]["update_s"] > 0
    nccl = record["methods"]["nccl"]["repeats"][0]["reconfigure"]
    assert nccl["stayer"]["busy_s"] > 0 and nccl["stayer"]["cpu_s"] > 0 and nccl["first_collective_s"] > 0  # the trainer takes part in the new group
    stages = [row["phase"] for row in record["summary"]["stages_p50"]]
    assert stages[:3] == ["init", "reconfigure", "destroy"] and stages[3].startswith("whole cycle")
    for text in ("process start + imports", "CUDA context", "reconfigure total", "peer that stays: wall time in calls",
                 "whole cycle", "NCCL / pool on"):
        assert text in out


def test_rejects_unknown_methods(capsys):
    assert main(["bench", "reconfigure", "--methods", "warm,bogus", "--devices=-1,-1"]) == 2
    assert "bogus" in capsys.readouterr().err
