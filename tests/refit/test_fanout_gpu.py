"""Fan-out on GPUs (cuda_ipc): a trainer and three engine processes, all pulling from the trainer
against fan-out in one run (``bench.fanout.run_fanout``), bit-exact, the trainer sending the
model three times against once per link. On one GPU, and across two where there are two."""

from __future__ import annotations

import pytest
import torch

from warmlink.bench.fanout import run_fanout
from warmlink.bench.model_spec import qwen3_4b_like
from warmlink.refit.plan import build_plan

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NUM_GPUS < 1, reason="needs CUDA")]


_TWO = [pytest.mark.multigpu, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("devices,install", [
    ((0, 0, 0, 0), "copy"),
    pytest.param((0, 1, 0, 1), "copy", marks=_TWO),
    pytest.param((0, 1, 0, 1), "swap", marks=_TWO),
], ids=["one-gpu", "two-gpus", "two-gpus-swap"])
def test_three_engines_with_fanout_take_the_model_from_the_trainer_once(devices, install):
    spec = qwen3_4b_like(0.02)
    layouts = list(spec.layouts(1, 0).values())
    model_nbytes = build_plan({0: layouts}, layouts).link_nbytes
    out = run_fanout(spec, engines=3, cycles=3, devices=devices, install=install, timeout_s=300)
    # one GPU: a star around replica 1, which takes it from the trainer; two: the first replica on
    # GPU1 from the trainer across NVLink, the one on GPU0 from the trainer within GPU0, the other on
    # GPU1 from the first there, so GPU0 -> GPU1 carries the model once (Note [Fan-out tree])
    one_gpu = devices[1] == devices[2]
    for mode, copies in (("trainer", 3), ("fanout", 1 if one_gpu else 2)):
        result = out["modes"][mode]
        assert result["correct"], (mode, result["bad"])
        assert [row["trainer_nbytes"] for row in result["cycles"]] == [copies * model_nbytes] * 3, (mode, result["cycles"])
    engines_on = {f"engine{i}": d for i, d in enumerate(devices[1:])}
    for row in out["modes"]["fanout"]["cycles"]:
        got = {e["replica"]: (engines_on[e["engine"]], sorted(e["sources"])) for e in row["engines"]}
        if one_gpu:  # member numbers follow the order of joining
            assert got == {1: (0, ["publishers"]), 2: (0, ["replica 1"]), 3: (0, ["replica 1"])}, row
            continue
        first_gpu1, second_gpu1 = sorted(m for m, (d, _) in got.items() if d == 1)
        assert got[first_gpu1][1] == ["publishers"] and got[second_gpu1][1] == [f"replica {first_gpu1}"], row
        assert [s for d, s in got.values() if d == 0] == [["publishers"]], row

