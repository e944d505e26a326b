"""``warmlink bench refit --backend nixl`` and ``bench lifecycle --backend nixl`` on CPU: the nixl
scenarios run beside the default transport's in one invocation, bit-exact, and warm cycles
register nothing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install warmlink[nixl])")

from warmlink.cli.main import main


def test_bench_refit_backend_nixl_runs_beside_the_default_transport(tmp_path, capsys):
    path = tmp_path / "refit.json"
    rc = main(["bench", "refit", "--scale", "0.001", "--cycles", "3", "--devices=-1,-1", "--scenarios", "warm",
               "--backend", "nixl", "--json", str(path), "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    record = json.loads(path.read_text())
    assert set(record["scenarios"]) == {"warm", "nixl", "nixl_cold", "nixl_rw"}
    for name in ("warm", "nixl", "nixl_cold"):
        assert record["scenarios"][name]["correct"] is True, name
    nixl = record["scenarios"]["nixl"]
    assert nixl["backend"] == "nixl" and nixl["pool"] is True
    assert all(c["created"].get("registration", 0) == 0 for c in nixl["cycles"][1:]), nixl["cycles"]
    rw = record["scenarios"]["nixl_rw"]
    assert rw["num_descs"] == record["num_tensors"]  # one descriptor per tensor: the gaps keep them apart
    for key in ("read", "write", "write_notify"):
        assert rw[key]["median_s"] > 0 and rw[key]["runs"] == 3
    assert record["nixl_vs_default"] > 0
    assert "READ (pull)" in out and "of its speed (goal >= 0.8)" in out


def test_bench_lifecycle_backend_nixl_keeps_the_agent_with_the_pool_on(tmp_path, capsys):
    path = tmp_path / "lifecycle.json"
    rc = main(["bench", "lifecycle", "--iterations", "3", "--tensors", "2", "--tensor-mib", "0.0625", "--devices=-1,-1",
               "--backend", "nixl", "--json", str(path), "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    record = json.loads(path.read_text())
    assert record["backend"] == "nixl" and "over nixl" in out
    on, off = record["modes"]["pool_on"]["iterations"], record["modes"]["pool_off"]["iterations"]
    for it in on[1:]:  # the agent (a pooled link) and its registrations survive the engines
        assert not any(it["created"]["trainer"].values()) and not any(it["created"]["inference"].values()), it["created"]
    assert all(it["created"]["trainer"].get("link", 0) == 1 for it in off)  # pool off: an agent per lifecycle
