"""``warmlink bench fp8`` on CPU: the record it writes (bytes moved, both timings, the share) and the
one-line refusals of what this machine cannot run. The GPU run is tests/refit/test_fp8_triton.py's."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from warmlink.bench.fp8 import linear_weights
from warmlink.cli.main import main


def test_the_record_counts_the_bytes_each_path_moves(tmp_path, capsys):
    path = tmp_path / "fp8.json"
    assert main(["bench", "fp8", "--scale", "0.005", "--repeats", "2", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "quantize to FP8 (torch)" in out and "flat copy, BF16" in out and "share of a flat copy" in out
    rec = json.loads(path.read_text())
    numel = sum(t.numel() for t in linear_weights(0.005, "cpu").values())
    blocks = sum(-(-t.shape[0] // 128) * -(-t.shape[1] // 128) for t in linear_weights(0.005, "cpu").values())
    assert rec["bench"] == "fp8" and rec["kernel"] == "torch" and rec["num_tensors"] == 4
    assert rec["bf16_nbytes"] == 2 * numel and rec["fp8_nbytes"] == numel + 4 * blocks
    assert rec["quantize"]["nbytes_moved"] == 3 * numel + 4 * blocks and rec["copy"]["nbytes_moved"] == 4 * numel
    for path_ in ("quantize", "copy"):
        row = rec[path_]
        assert len(row["all_ms"]) == 2 and row["ms"] > 0
        assert row["gbps"] == pytest.approx(row["nbytes_moved"] / (row["ms"] / 1e3) / 1e9)
    assert rec["share_of_copy"] == pytest.approx(rec["quantize"]["gbps"] / rec["copy"]["gbps"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA refuses these")
@pytest.mark.parametrize("args,named", [
    (["--device", "cuda:0"], "--device='cuda:0'"),
    (["--device", "cpu", "--kernel", "triton"], "kernel='triton'"),
    (["--scale", "0"], "--scale"),
])
def test_what_this_machine_cannot_run_is_one_line_and_exit_code_2(args, named, capsys):
    with pytest.raises(SystemExit) if args[0] == "--scale" else contextlib.nullcontext():  # argparse's own refusal
        assert main(["bench", "fp8", "--repeats", "1", "--scale", "0.005", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and named in err, err
