"""Tiny but faithful Qwen3 and DeepSeek-V3 models for FP8 refit tests, and a gloo world of trainer
ranks that publish what they are sent quantized with ``Fp8(group=...)``.

The shapes keep what FP8 layouts depend on: widths that are multiples of 128 and widths that are
not (hidden 320: partial blocks along K of every projection, along N of o_proj and down_proj),
GQA with KV heads of 128 rows, fused QKV and gate/up, DeepSeek's MLA (``fused_qkv_a_proj`` =
``[q_a (256 rows); kv_a_proj_with_mqa (192 rows, a partial block at its end)]``) and stacked
experts, all divisible as vLLM requires at TP 2.
"""

from __future__ import annotations

import os
from functools import lru_cache

from _spawned import Workers, close_keys, serve

TIMEOUT_S = 120.0
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=128, tie_word_embeddings=False)
CONFIGS = {
    "qwen3": dict(hidden_size=320, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, **_IDS),
    "deepseek_v3": dict(hidden_size=320, intermediate_size=512, moe_intermediate_size=256, n_routed_experts=4,
                        n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=2, **_IDS),
}


@lru_cache(maxsize=None)
def model(family: str):
    """The transformers model, bfloat16, every tensor seeded random with rows of every magnitude
    (blocks whose amaxes differ by 10^4)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(family, **CONFIGS[family])
    m = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    m.config.dtype = torch.bfloat16  # what layouts of the config say, as a BF16 checkpoint's config does
    fill(m, seed=sum(map(ord, family)))
    return m


def state(m, seed: int | None = None) -> dict:
    """``m``'s tensors by name (``module_tensors``), or, with ``seed``, new values of their shapes."""
    import torch

    from warmlink.refit._declare import module_tensors

    tensors = module_tensors(m)
    if seed is None:
        return {n: t.detach().clone() for n, t in tensors.items()}
    gen = torch.Generator().manual_seed(seed)
    return {n: _values(t.shape, gen).to(t.dtype) for n, t in tensors.items()}


def fill(m, seed: int) -> None:
    import torch

    from warmlink.refit._declare import module_tensors

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module_tensors(m).values():
            t.copy_(_values(t.shape, gen))


def _values(shape, gen):
    import torch

    x = torch.randn(shape, generator=gen)
    if len(shape) >= 2:  # rows from 1e-3 to 10: every block, row and tensor its own scale
        rows = torch.logspace(-3, 1, shape[-2])[torch.randperm(shape[-2], generator=gen)]
        x = x * rows[:, None]
    return x


# -- a gloo world of trainer ranks ------------------------------------------------------------------
def trainer_layouts(family: str, cut: str, world: int, rank: int) -> dict:
    """This rank's layouts: ``"hf"`` as transformers' TP plan shards them, or ``"rows"``: every
    quantized weight split along its rows by ``torch.tensor_split`` (FSDP-like cuts, some mid-block:
    o_proj and down_proj's 320 rows at 160), the rest whole."""
    from warmlink.refit import TensorLayout
    from warmlink.refit.families import fp8_weights, layouts

    m = model(family)
    hf = layouts(m, convention="hf", tp=world, rank=rank)
    if cut == "hf":
        return hf
    weights = fp8_weights(m)
    whole = layouts(m, convention="hf", tp=1, rank=0)
    return {n: (TensorLayout.plain(n, lay.dtype, lay.shape, split_dim=0, num_shards=world, shard_idx=rank)
                if n in weights else lay) for n, lay in whole.items()}


def local(tensor, layout):
    """The box of ``tensor`` (a whole logical tensor) one single-part ``layout`` holds."""
    (part,) = layout.parts
    return tensor[tuple(slice(a, b) for a, b in part.shard.bounds)].contiguous()


def _cmd_init(state_, *, rank, world, init_file):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return rank


def _cmd_publish(state_, *, rank, world, address, secret, prefix, scheme, layouts, tensors, weights):
    """Publish ``tensors`` (this rank's, by name) in ``layouts``, those of ``weights`` quantized with
    ``Fp8(scheme, group=WORLD)``; ``export`` is collective (the group agrees on what it quantizes,
    then reduces the first version's cells)."""
    import torch.distributed as dist

    from warmlink.refit import Publisher
    from warmlink.refit.fp8 import Fp8
    from warmlink.rendezvous import Store

    _cmd_close(state_)
    store = state_["store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
    pub = state_["pub"] = Publisher(store, rank=rank, world_size=world, backend="shm", timeout_s=TIMEOUT_S)
    spec = Fp8(scheme, group=dist.group.WORLD)
    for n, lay in layouts.items():
        pub.add(n, tensors[n], lay, fp8=spec if n in weights else None)
    pub.export()
    state_["tensors"] = tensors
    return pub.version


def _cmd_step(state_, *, tensors):
    """Publish the next version, ``tensors`` copied into the live ones (collective: ``publish``
    reduces the cells' amaxes over the group)."""
    pub = state_["pub"]
    with pub.update():
        for n, t in state_["tensors"].items():
            t.copy_(tensors[n])
    return pub.version


def _cmd_close(state_):
    close_keys(state_, "pub", "store")


def _reset(state_):
    import torch.distributed as dist

    _cmd_close(state_)
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(control, results):
    serve(control, results, {"init": _cmd_init, "publish": _cmd_publish, "step": _cmd_step, "close": _cmd_close}, {},
          _reset)


class World(Workers):
    """``world`` trainer ranks in one gloo group, each publishing what it is sent. They import torch
    and warmlink only: the test builds layouts and tensors and sends them."""

    def __init__(self, world: int, tmp_path) -> None:
        super().__init__(_worker, world, TIMEOUT_S)
        try:
            init_file = os.path.join(str(tmp_path), f"pg-{world}")
            self.call_all("init", lambda r: dict(rank=r, world=world, init_file=init_file))
        except BaseException:
            self.close()
            raise
