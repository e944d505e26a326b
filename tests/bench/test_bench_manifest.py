"""``warmlink bench manifest`` on CPU: export and first plan of a DeepSeek-V3-shaped manifest."""

from __future__ import annotations

import collections
import json

import pytest

from warmlink.bench.manifest import deepseek_v3_like
from warmlink.cli.main import main


def test_model_is_deepseek_v3_shaped() -> None:
    full = deepseek_v3_like(45_395, 2, 1)  # the whole model: 61 layers, 3 dense, 256 experts
    assert len(full) == 45_395 and list(full)[-3:] == ["model.layers.60.mlp.experts.255.down_proj.weight",
                                                      "model.norm.weight", "lm_head.weight"]
    expert = full["model.layers.57.mlp.experts.211.down_proj.weight"]
    assert expert.dtype == "bfloat16" and expert.parts[0].shard.bounds == ((0, 56), (8, 16))  # row-parallel, rank 1
    kinds = collections.Counter(n.rsplit(".", 2)[-2] for n in full)
    assert kinds["gate_proj"] == kinds["up_proj"] == kinds["down_proj"]
    assert [len(deepseek_v3_like(n, 1, 0)) for n in (1, 2, 3, 1000)] == [1, 2, 3, 1000]


def test_prints_both_tables_and_writes_a_record(tmp_path, capsys) -> None:
    path = tmp_path / "manifest.json"
    assert main(["bench", "manifest", "--tensors", "300", "--json", str(path), "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    for text in ("300 tensors x 2 publisher ranks", "export (ms", "first plan (ms)", "TP-2 rank 0 (matched)", "TP-1 rank 0",
                 "record:"):
        assert text in out, text
    record = json.loads(path.read_text())
    assert record["bench"] == "manifest" and record["num_tensors"] == 300 and record["tp"] == 2
    assert record["machine"]["cpu_count"] >= 1 and record["receiver_tps"] == [2, 1]
    assert [p["rank"] for p in record["publishers"]] == [0, 1]
    assert all(p["export_s"] > 0 and p["manifest_nbytes"] > 0 for p in record["publishers"])
    matched, gather = record["receivers"]
    assert matched["num_runs"] == 300 and gather["num_runs"] > 300  # TP-1 reads both shards of split tensors
    for phase in ("read_s", "decode_s", "layouts_s", "signature_s", "plan_s"):
        assert 0 <= matched[phase] <= matched["total_s"]


def test_help_explains_the_bench(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "manifest", "--help"])
    out = capsys.readouterr().out
    for text in ("--tensors", "--tp", "--receiver-tp", "--json", "build_plan"):
        assert text in out, text


@pytest.mark.parametrize("args, field", [
    (["--tensors", "0"], "--tensors=0"), (["--tp", "9"], "--tp=9"), (["--receiver-tp", "2,x"], "--receiver-tp='2,x'"),
    (["--receiver-tp", "0"], "--receiver-tp='0'"), (["--timeout", "0"], "--timeout=0"),
])
def test_rejects_bad_arguments_in_one_line(capsys, args, field) -> None:
    assert main(["bench", "manifest", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warmlink bench manifest: ") and field in err[0], err
