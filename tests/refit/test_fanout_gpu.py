"""Fan-out on GPUs (cuda_ipc): a trainer and three engine processes, all pulling from the trainer
against fan-out in one run (``bench.fanout.run_fanout``), bit-exact, the trainer sending the
model three times against once. On one GPU, and across two where there are two."""

from __future__ import annotations

import pytest
import torch

from warmlink.bench.fanout import run_fanout
from warmlink.bench.model_spec import qwen3_4b_like
from warmlink.refit.plan import build_plan

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NUM_GPUS < 1, reason="needs CUDA")]


@pytest.mark.parametrize("devices", [
    (0, 0, 0, 0),
    pytest.param((0, 1, 0, 1), marks=[pytest.mark.multigpu, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA devices")]),
], ids=["one-gpu", "two-gpus"])
def test_three_engines_with_fanout_take_the_model_from_the_trainer_once(devices):
    spec = qwen3_4b_like(0.02)
    layouts = list(spec.layouts(1, 0).values())
    model_nbytes = build_plan({0: layouts}, layouts).link_nbytes
    out = run_fanout(spec, engines=3, cycles=3, devices=devices, timeout_s=300)
    for mode, copies in (("trainer", 3), ("fanout", 1)):
        result = out["modes"][mode]
        assert result["correct"], (mode, result["bad"])
        assert [row["trainer_nbytes"] for row in result["cycles"]] == [copies * model_nbytes] * 3, (mode, result["cycles"])
    # one GPU: a chain; two: replicas 2 (GPU0) and 3 (GPU1) both take it from replica 1 (GPU1), so
    # GPU0 -> GPU1 carries the model once (Note [Fan-out tree])
    served = {"publishers", "replica 1", "replica 2"} if devices[1] == devices[2] else {"publishers", "replica 1"}
    for row in out["modes"]["fanout"]["cycles"]:
        assert set(row["sources"]) == served, row
