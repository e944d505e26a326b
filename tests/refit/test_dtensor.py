"""Refit from parameters PyTorch shards itself: FSDP2, ``parallelize_module`` and a 2-D mesh.

Trainer ranks (gloo worlds of 2 and 4) publish their DTensors with ``Publisher.add_module`` and
nothing else: no layout is written by hand, the boxes come from the placements. Dimensions divide
by no world size (vocab 1001, intermediate 100, 6 experts over 4 ranks gives [2, 2, 2, 0]).
Receivers here hold the HF model whole, and vLLM-layout ranks at TP = world size hold their
slices (fused, padded vocabulary); after version 1 and after an optimizer step (version 2) every
tensor must equal the trainer's ``full_tensor()``, or the reference built from it with plain torch
ops, bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from _dtensor_world import World, tiny_model
from _harness import new_store, zeros_like_layout
from _references import ref_vllm

from warmlink.refit import Receiver
from warmlink.refit.families import layouts
from warmlink.rendezvous import Store

MODES = {2: ("fsdp", "tp"), 4: ("fsdp", "tp", "2d")}


def _receive_vllm(store, world: int, tp: int):
    """``tp`` receivers in vLLM's layout, each holding zeros until the refit fills its slices."""
    out = []
    for r in range(tp):
        lays = layouts(tiny_model(seed=1).config, convention="vllm", tp=tp, rank=r)
        rec = Receiver(store, num_publishers=world, backend="shm", timeout_s=120)
        targets = {n: zeros_like_layout(lay) for n, lay in lays.items()}
        for n, lay in lays.items():
            rec.add(n, lay, targets[n])
        out.append((rec, targets))
    return out


def _receive_whole(store, world: int):
    """A receiver holding an HF model of the same config whole (TP 1)."""
    model = tiny_model(seed=1)  # other values: every byte must come from the refit
    rec = Receiver(store, num_publishers=world, backend="shm", timeout_s=120)
    rec.add_module(model)
    return rec, model


@pytest.mark.parametrize("world", sorted(MODES))
def test_dtensor_publishers_refit_whole_model_bit_exact(world, tmp_path):
    """One gloo world per size; each rank holds one model per way of sharding, each published
    under its own store prefix, each received whole here."""
    server = new_store()
    prefixes = {mode: f"{server.prefix}-{mode}" for mode in MODES[world]}
    clients = {mode: Store.connect(server.address, prefix=p, timeout_s=120, secret=server.secret) for mode, p in prefixes.items()}
    trainers = World(world, prefixes, server.address, server.secret, tmp_path)
    try:
        for mode in MODES[world]:
            kinds = [k[mode] for k in trainers.kinds]
            assert "DTensor" in {kind for kind, _ in kinds[0].values()}, kinds
            if mode == "fsdp" and world == 4:  # torch.chunk: 6 experts over 4 ranks are [2, 2, 2, 0]
                rows = [k["model.layers.1.mlp.experts.gate_up_proj"][1][0][0] for k in kinds]
                assert [b - a for a, b in rows] == [2, 2, 2, 0] and rows[:3] == [(0, 2), (2, 4), (4, 6)], rows
            rec, model = _receive_whole(clients[mode], world)
            vllm = _receive_vllm(clients[mode], world, tp=world)
            cfg = model.config
            with contextlib.ExitStack() as closing:
                for r in (rec, *(v for v, _ in vllm)):
                    closing.callback(r.close)
                for version in (1, 2):
                    if version == 2:
                        assert trainers.call_all("step", lambda r: {"mode": mode, "version": 2}) == [2] * world
                    full = trainers.call_all("full", lambda r: {"mode": mode})[0]
                    report = rec.refit()
                    assert report.version == version
                    got = dict(model.named_parameters())
                    wrong = [n for n, t in full.items() if not torch.equal(got[n].detach(), t)]
                    assert wrong == [], f"{mode} world {world} version {version}: {wrong}"
                    for r, (vrec, targets) in enumerate(vllm):
                        assert vrec.refit().version == version
                        want = ref_vllm(cfg, full, world, r)
                        assert set(want) == set(targets)
                        wrong = [n for n, t in targets.items() if not torch.equal(t, want[n])]
                        assert wrong == [], f"{mode} world {world} -> vllm tp {world} rank {r} v{version}: {wrong}"
                assert report.created == {"arena": 0, "registration": 0, "peer_mapping": 0, "plan": 0}
    finally:
        trainers.close()
        for s in (*clients.values(), server):
            s.close()


# One process posing as rank 1 of 4 (PyTorch's fake process group): placements only, no collective.
_FAKE_RANK = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from warmlink.refit._declare import declare_tensor
from warmlink.refit.dtensor import dtensor_layout
from warmlink.refit.manifest import TensorLayout
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # rank 1: dp 0, tp 1
def dt(m, placements, local):
    return DTensor.from_local(torch.zeros(local), m, placements, run_check=False, shape=(4, 4), stride=(4, 1))
hsdp = dt(mesh, (Replicate(), Shard(0)), (2, 4))
found = {
    "hsdp": dtensor_layout("w", hsdp),
    "2d": dtensor_layout("w", dt(mesh, (Shard(0), Shard(1)), (2, 2))),
    "dp slice of 2d": dtensor_layout("w", dt(mesh["dp"], (Shard(0),), (2, 4))),
    "flattened": dtensor_layout("w", dt(mesh["dp", "tp"]._flatten(), (Shard(0),), (1, 4))),
    "1d": dtensor_layout("w", dt(init_device_mesh("cpu", (4,)), (Shard(0),), (1, 4))),
    # a hand-written layout of an HSDP DTensor takes its flags from the placements
    "given": declare_tensor("w", hsdp, TensorLayout.plain("w", "float32", (4, 4), 0, 2, 1)).layout,
}
print({k: ([p.shard.bounds for p in v.parts], [p.replicated for p in v.parts]) for k, v in found.items()})
"""


def test_placements_mark_replicas():
    """Note [DTensor replicas]: ``Replicate()`` on a mesh dimension (HSDP) and a mesh sliced from a
    larger one (FSDP over ``mesh["dp"]`` of a 2-D mesh, as the 2-D mode above does for the norms)
    mark parts replicated; a mesh over every rank of its root does not."""
    import ast
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _FAKE_RANK], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    found = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert found == {
        "hsdp": ([((2, 4), (0, 4))], [True]),
        "2d": ([((0, 2), (2, 4))], [False]),
        "dp slice of 2d": ([((0, 2), (0, 4))], [True]),
        "flattened": ([((1, 2), (0, 4))], [False]),
        "1d": ([((1, 2), (0, 4))], [False]),
        "given": ([((2, 4), (0, 4))], [True]),
    }, found
