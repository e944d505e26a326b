"""``bench.fanout.run_fanout``: N replicas all pulling from the trainer against fan-out, in one run
on the CPU (shm): both bit-exact, the trainer sending the model N times in one mode and once in the
other, with what the replicas sent each other accounted for."""

from __future__ import annotations

from warmlink.bench.fanout import run_fanout
from warmlink.bench.model_spec import qwen3_4b_like
from warmlink.refit.plan import build_plan


def test_fanout_sends_the_model_once_where_pulling_from_the_trainer_sends_it_per_engine():
    spec = qwen3_4b_like(0.001)  # ~1 MB
    layouts = list(spec.layouts(1, 0).values())
    model_nbytes = build_plan({0: layouts}, layouts).link_nbytes
    out = run_fanout(spec, engines=2, cycles=2, chunk_bytes=64 << 10, timeout_s=240)
    assert out["engines"] == 2 and set(out["modes"]) == {"trainer", "fanout"}
    for mode, engines_per_byte in (("trainer", 2), ("fanout", 1)):
        result = out["modes"][mode]
        assert result["correct"], (mode, result["bad"])
        for row in result["cycles"]:
            assert row["trainer_nbytes"] == engines_per_byte * model_nbytes, (mode, row)
            assert row["wall_s"] > 0 and row["slowest_s"] > 0
    for row in out["modes"]["fanout"]["cycles"]:  # replica 1 served the model to replica 2
        assert set(row["sources"]) == {"publishers", "replica 1"}, row
        assert row["relay_nbytes"] >= model_nbytes
    assert all(row["relay_nbytes"] == 0 for row in out["modes"]["trainer"]["cycles"])


def test_bench_refit_engines_prints_pull_beside_fanout_on_this_machine(tmp_path, capsys):
    """``warmlink bench refit --engines 1,2 --install copy,swap`` without --hosts: the CLI over
    run_fanout, on the CPU, each install mode against its own one-engine time."""
    import json

    from warmlink.cli.main import main

    record = tmp_path / "engines.json"
    rc = main(["bench", "refit", "--engines", "1,2", "--devices=-1,-1", "--scale", "0.001", "--cycles", "2", "--fanout-chunks", "8",
               "--install", "copy,swap", "--timeout", "120", "--json", str(record)])
    out = capsys.readouterr().out
    assert rc == 0, out
    runs = json.loads(record.read_text())["runs"]
    assert [(r["install"], r["engines"]) for r in runs] == [("copy", 1), ("copy", 2), ("swap", 1), ("swap", 2)]
    assert all(m["correct"] for r in runs for m in r["modes"].values())
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["copy"], ["swap"])]
    # install, engines, mode, first, warm, vs 1 engine, GB/s, trainer sent (models), exact
    for install, block in (("copy", rows[:4]), ("swap", rows[4:])):
        assert [(r[0], r[1], r[2], r[5], r[7], r[8]) for r in block] == [
            (install, "1", "pull", "1.00x", "1.00", "yes"), (install, "1", "fanout", "1.00x", "1.00", "yes"),
            (install, "2", "pull", block[2][5], "2.00", "yes"), (install, "2", "fanout", block[3][5], "1.00", "yes")], out


def test_bench_refit_engines_refuses_direct_install(capsys):
    from warmlink.cli.main import main

    assert main(["bench", "refit", "--engines", "2", "--devices=-1,-1", "--install", "direct"]) == 2
    assert "--install='direct' with --engines" in capsys.readouterr().err
