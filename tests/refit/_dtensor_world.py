"""A gloo world of trainer ranks whose parameters PyTorch shards itself (FSDP2, TP, both).

Each rank is a ``SpawnedWorker``; collectives need every rank inside the same command, so the
test sends a command to all ranks first and collects afterwards (``World.call_all``).
"""

from __future__ import annotations

import os

from _spawned import Workers, serve

TIMEOUT_S = 120.0

# Dimensions that no world size divides: vocab 1001, intermediate 100, 6 experts over 4 ranks.
CONFIG = dict(vocab_size=1001, hidden_size=16, intermediate_size=100, moe_intermediate_size=12, num_experts=6,
              num_experts_per_tok=2, num_hidden_layers=2, mlp_only_layers=[0], num_attention_heads=4,
              num_key_value_heads=2, head_dim=4, tie_word_embeddings=False)


def tiny_model(seed: int = 0):
    """A Qwen3-MoE with layer 0 dense (intermediate 100) and layer 1 sparse (6 experts)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**CONFIG)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():  # every element distinct from its neighbours: a misplaced one shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def _tp_plan(mesh_tp):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "lm_head": ColwiseParallel()}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        if i in CONFIG["mlp_only_layers"]:
            plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return plan


def _shard(model, mode: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "tp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, _tp_plan(mesh))
    elif mode == "2d":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan(mesh["tp"]))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(mode)


def _cmd_init(state, *, rank, world, modes, init_file, address, secret):
    """One model per mode, each sharded by PyTorch and published under the store prefix of its mode."""
    import datetime

    import torch
    import torch.distributed as dist

    from warmlink.refit import Publisher
    from warmlink.rendezvous import Store

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out = {}
    for mode, prefix in modes.items():
        model = tiny_model()
        _shard(model, mode, world)
        store = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
        pub = Publisher(store, rank=rank, world_size=world, backend="shm", timeout_s=TIMEOUT_S)
        pub.add_module(model)
        pub.export()
        state.setdefault("models", {})[mode] = (model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), pub)
        state.setdefault("stores", []).append(store)
        published = pub.layouts()
        out[mode] = {n: (type(p).__name__, [part.shard.bounds for part in published[n].parts])
                     for n, p in model.named_parameters()}
    return out


def _cmd_step(state, *, mode, version):
    """One optimizer step inside ``update``: receivers see version ``version`` only once it is done."""
    import torch

    model, opt, pub = state["models"][mode]
    with pub.update():
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 0.125 * (version + i % 3))
        opt.step()
        opt.zero_grad()
    return pub.version


def _cmd_full(state, *, mode):
    """Every parameter whole (a collective: all ranks at once), for the test's reference."""
    out = {}
    for name, p in state["models"][mode][0].named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _reset(state):
    import torch.distributed as dist

    for _, _, pub in state.pop("models", {}).values():
        pub.close()
    for store in state.pop("stores", []):
        store.close()
    if dist.is_initialized():
        dist.destroy_process_group()


COMMANDS = {"init": _cmd_init, "step": _cmd_step, "full": _cmd_full}


def _worker(control, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve(control, results, COMMANDS, {}, _reset)


class World(Workers):
    """``world`` trainer ranks, each holding one model per mode ("fsdp", "tp", "2d") sharded that
    way and published under ``modes[mode]``, a store prefix of the server at ``address`` (its secret ``secret``)."""

    def __init__(self, world: int, modes: dict[str, str], address: str, secret: str, tmp_path) -> None:
        super().__init__(_worker, world, TIMEOUT_S)
        init_file = os.path.join(str(tmp_path), f"pg-{world}")
        try:
            self.kinds = self.call_all("init", lambda r: dict(rank=r, world=world, modes=modes, init_file=init_file,
                                                              address=address, secret=secret))
        except BaseException:
            self.close()
            raise
