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
