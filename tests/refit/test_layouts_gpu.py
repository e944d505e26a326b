"""Framework layouts over CUDA IPC: FSDP2 DTensor shards and Megatron's QKV, on one GPU.

Two trainer processes share GPU 0 (two processes on one GPU still map each other's memory over
CUDA IPC). FSDP2 shards a CUDA model with ``fully_shard`` and publishes the local shards in place
(caching-allocator memory, registered as IPC handles); the receiver here holds the model whole.
Megatron-layout ranks publish ``linear_qkv`` interleaved per query group and a padded vocabulary;
receivers in the vLLM layout and whole HF tensors check every byte. References are full tensors
computed here with plain torch ops on the same device.
"""

from __future__ import annotations

import datetime
import os
import uuid

import pytest
import torch

from _dtensor_world import tiny_model
from _spawned import SpawnedWorker, close_keys, serve

from warmlink._dtypes import dtype_name
from warmlink.refit import Receiver, TensorLayout
from warmlink.rendezvous import Store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TIMEOUT_S = 120.0
WORLD = 2


def _grads(params, version: int):
    """The step's gradients, the same function of (parameter index, version) on every side."""
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.125 * (version + i % 3))


def _cmd_fsdp_init(state, *, rank, init_file, address, secret, prefix):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from warmlink.refit import Publisher

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # the device is chosen: DeviceMesh keeps it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = tiny_model().cuda()  # the same seed on every rank: each keeps its own chunk, no collective
    mesh = init_device_mesh("cuda", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state["model"] = model
    state["opt"] = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=False)
    state["store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
    pub = state["pub"] = Publisher(state["store"], rank=rank, world_size=WORLD, backend="cuda_ipc", timeout_s=TIMEOUT_S)
    pub.add_module(model)
    pub.export()
    return sorted({type(p).__name__ for p in model.parameters()})


def _cmd_fsdp_step(state, *, version):
    model, opt, pub = state["model"], state["opt"], state["pub"]
    with pub.update():
        _grads(list(model.parameters()), version)
        opt.step()  # pointwise on each shard: the same bits as on the full tensor
        opt.zero_grad()
    return pub.version


def _reset(state):
    import torch.distributed as dist

    close_keys(state, "pub", "store")
    if dist.is_initialized():
        dist.destroy_process_group()


def _fsdp_worker(control, results):
    serve(control, results, {"init": _cmd_fsdp_init, "step": _cmd_fsdp_step}, {}, _reset)


def _call_all(workers, cmd, kwargs=lambda r: {}):
    for r, w in enumerate(workers):
        w.send(cmd, **kwargs(r))
    return [w.result(TIMEOUT_S) for w in workers]


def test_fsdp2_shards_over_cuda_ipc_bit_exact(tmp_path):
    prefix = f"fsdp-gpu-{uuid.uuid4().hex[:8]}"
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix, timeout_s=TIMEOUT_S) as store:
        workers = [SpawnedWorker(_fsdp_worker) for _ in range(WORLD)]
        try:
            init_file = os.path.join(str(tmp_path), "pg")
            kinds = _call_all(workers, "init", lambda r: dict(rank=r, init_file=init_file, address=store.address, secret=store.secret,
                                                                prefix=prefix))
            assert kinds[0] == ["DTensor"], kinds
            torch.cuda.set_device(0)
            ref = tiny_model().cuda()
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9, foreach=False)
            engine = tiny_model(seed=1).cuda()
            with Receiver(store, num_publishers=WORLD, backend="cuda_ipc", timeout_s=TIMEOUT_S) as rec:
                rec.add_module(engine)
                for version in (1, 2):
                    if version == 2:
                        assert _call_all(workers, "step", lambda r: {"version": 2}) == [2] * WORLD
                        _grads(list(ref.parameters()), 2)
                        ref_opt.step()
                    report = rec.refit()
                    assert report.version == version
                    got = dict(engine.named_parameters())
                    wrong = [n for n, p in ref.named_parameters() if not torch.equal(got[n].detach(), p.detach())]
                    assert wrong == [], f"version {version}: {wrong}"
                assert report.created == {"arena": 0, "registration": 0, "peer_mapping": 0, "plan": 0}
        finally:
            for w in workers:
                w.stop()


# -- Megatron-layout publishers over CUDA IPC ------------------------------------------------------
MEGATRON_FAMILIES = ("qwen2", "llama")  # two query groups per rank at tp=2; one group per rank


def _cmd_megatron_init(state, *, family, rank, address, secret, prefix):
    from _megatron_ref import DIVISIBLE, hf_config, hf_model, hf_state, megatron_rank

    from warmlink.refit import Publisher
    from warmlink.refit.families import layouts

    torch.cuda.set_device(0)
    config = hf_config(family)
    tensors = {n: t.cuda() for n, t in megatron_rank(hf_state(hf_model(family)), config, tp=WORLD, rank=rank,
                                                          divisible=DIVISIBLE).items()}
    lays = layouts(config, convention="megatron", tp=WORLD, rank=rank, make_vocab_size_divisible_by=DIVISIBLE)
    state["store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
    pub = state["pub"] = Publisher(state["store"], rank=rank, world_size=WORLD, backend="cuda_ipc", timeout_s=TIMEOUT_S)
    for name, lay in lays.items():
        pub.add(name, tensors[name], lay)  # in place: caching-allocator memory shared as IPC handles
    pub.export()
    state["tensors"] = tensors
    return sorted(lays)


def _cmd_megatron_step(state):
    """Version 2: every element + 1 (padding rows too: padding is never sent, so nobody sees them)."""
    pub = state["pub"]
    with pub.update():
        for t in state["tensors"].values():
            t.add_(1)
    return pub.version


def _megatron_worker(control, results):
    serve(control, results, {"init": _cmd_megatron_init, "step": _cmd_megatron_step}, {}, _reset)


@pytest.mark.parametrize("family", MEGATRON_FAMILIES)
def test_megatron_qkv_and_padded_vocab_over_cuda_ipc_bit_exact(family):
    """Megatron TP-2 ranks (QKV interleaved per query group, vocabulary padded to 64 * tp) into
    vLLM-layout TP-2 ranks and a whole HF model, on GPU 0, over two versions."""
    from _megatron_ref import hf_config, hf_model, hf_state
    from _references import ref_vllm

    from warmlink.refit.families import layouts

    prefix = f"megatron-gpu-{uuid.uuid4().hex[:8]}"
    config = hf_config(family)
    state0 = {n: t.cuda() for n, t in hf_state(hf_model(family)).items()}
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix, timeout_s=TIMEOUT_S) as store:
        workers = [SpawnedWorker(_megatron_worker) for _ in range(WORLD)]
        receivers = []
        try:
            names = _call_all(workers, "init", lambda r: dict(family=family, rank=r, address=store.address, secret=store.secret, prefix=prefix))
            assert any("linear_qkv" in n for n in names[0]), names[0]
            torch.cuda.set_device(0)
            whole = {n: torch.zeros_like(t) for n, t in state0.items()}
            rec = Receiver(store, num_publishers=WORLD, backend="cuda_ipc", timeout_s=TIMEOUT_S)
            for n, t in whole.items():
                rec.add(n, TensorLayout.plain(n, dtype_name(t.dtype), tuple(t.shape)), t)
            receivers.append((rec, whole, None))
            for r in range(WORLD):
                lays = layouts(config, convention="vllm", tp=WORLD, rank=r)
                targets = {n: torch.zeros(lay.shape, dtype=getattr(torch, lay.dtype), device="cuda") for n, lay in lays.items()}
                vrec = Receiver(store, num_publishers=WORLD, backend="cuda_ipc", timeout_s=TIMEOUT_S)
                for n, lay in lays.items():
                    vrec.add(n, lay, targets[n])
                receivers.append((vrec, targets, r))
            for version in (1, 2):
                if version == 2:
                    assert _call_all(workers, "step") == [2] * WORLD
                full = {n: t + (version - 1) for n, t in state0.items()}
                for rec, targets, r in receivers:
                    assert rec.refit().version == version
                    want = full if r is None else ref_vllm(config, full, WORLD, r)
                    wrong = [n for n in want if not torch.equal(targets[n], want[n])]
                    assert wrong == [], f"{family} v{version} {'whole' if r is None else f'vllm rank {r}'}: {wrong}"
        finally:
            for rec, _, _ in receivers:
                rec.close()
            for w in workers:
                w.stop()
