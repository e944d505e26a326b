"""``warmlink bench lifecycle`` on CPU: engines created and destroyed again and again (seed 002)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from warmlink.bench.lifecycle import PHASES
from warmlink.cli.main import main

ITERATIONS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("lifecycle") / "lifecycle.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "lifecycle", "--iterations", str(ITERATIONS), "--tensors", "3", "--tensor-mib", "0.0625",
                   "--devices=-1,-1", "--json", str(path), "--timeout", "60"])
    assert rc == 0, out.getvalue()
    return json.loads(path.read_text()), out.getvalue()


def _created(it: dict, side: str) -> dict:
    return {k: v for k, v in it["created"][side].items() if v}


def test_record_has_every_phase_of_every_lifecycle(run):
    record, _out = run
    assert record["bench"] == "lifecycle" and record["schema_version"] == 1 and record["iterations"] == ITERATIONS
    assert record["devices"] == [-1, -1] and record["num_tensors"] == 3
    for mode in ("pool_on", "pool_off"):
        res = record["modes"][mode]
        assert res["correct"] is True
        assert res["pool"] is (mode == "pool_on")
        assert [it["iteration"] for it in res["iterations"]] == list(range(1, ITERATIONS + 1))
        for it in res["iterations"]:
            assert all(it[key] >= 0 for _label, key in PHASES)
            assert it["total_s"] > 0 and it["wall_s"] >= it["total_s"] * 0.5
            assert it["refit"]["nbytes"] == 3 * 32 * 1024 * 2
            assert set(it["created"]) == {"trainer", "inference"}
        assert res["total_s"] == pytest.approx(sum(it["total_s"] for it in res["iterations"]))
        assert set(res["final"]) == {"trainer", "inference"}
    assert record["totals"]["ratio"] > 0
    labels = [row["phase"] for row in record["summary"]]
    assert "total per lifecycle" in labels and "created (inference)" in labels


def test_pool_off_creates_on_every_lifecycle(run):
    record, _out = run
    for it in record["modes"]["pool_off"]["iterations"]:
        assert _created(it, "trainer") and _created(it, "inference"), it["created"]


def test_pool_on_warm_lifecycles_create_nothing(run):
    record, _out = run
    first, *warm = record["modes"]["pool_on"]["iterations"]
    assert _created(first, "trainer") and _created(first, "inference")  # the first one fills the pool
    for it in warm:  # links, arenas, registrations, mappings and plans all come back from the pool
        assert _created(it, "trainer") == {} and _created(it, "inference") == {}, it["created"]
    # The publisher process exports one staging region: its one mapping stays open, none piles up.
    assert record["modes"]["pool_on"]["final"]["inference"]["open_mappings"] <= 1
    assert record["modes"]["pool_off"]["final"]["inference"]["open_mappings"] == 0


def test_table_is_printed(run):
    _record, out = run
    for text in ("engine lifecycle, per lifecycle", "publisher export", "receiver close", "total per lifecycle",
                 f"total for {ITERATIONS} lifecycles", "pool off / pool on"):
        assert text in out


def test_rejects_bad_arguments(capsys):
    assert main(["bench", "lifecycle", "--iterations", "0", "--devices=-1,-1"]) == 2
    assert "--iterations" in capsys.readouterr().err
