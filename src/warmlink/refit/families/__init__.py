"""Layouts of Hugging Face architectures as each framework holds them, for ranks without DTensors.

``layouts(model_or_config, convention=..., tp=..., rank=...)`` says, for every tensor one rank of
a framework holds, which boxes of which logical tensors it holds and where. Logical tensors are
the transformers model's own parameters and persistent buffers (``families._model``). The
convention is always named, never guessed: the same bytes mean different things in Megatron's
fused QKV (interleaved per query group) and vLLM's (``[q; k; v]`` per rank), so each convention
also has its own physical names, and a layout of one cannot be published as the other's module.

Conventions (``CONVENTIONS``):

* ``"hf"``: the transformers names, unfused, sharded as transformers' own ``tp_plan`` shards them.
* ``"vllm"``: vLLM's modules (fused ``qkv_proj`` / ``gate_up_proj``, padded vocabulary, stacked
  experts ``w13_weight`` / ``w2_weight``, expert parallel).
* ``"megatron"``: Megatron-core's modules (QKV interleaved per query group, padded vocabulary,
  ``linear_fc1`` = ``[gate; up]``, experts per EP rank).

With ``fp8=scheme`` the weights vLLM's FP8 layers hold (``fp8_weights``) are FP8 values beside
their scales (Note [FP8 formats] in ``refit.fp8``): what an FP8 engine rank takes from a trainer
that publishes with ``Fp8(scheme, logical=fp8_weights(config))``.
"""

from __future__ import annotations

import importlib
from typing import Any

from warmlink.errors import LayoutError
from warmlink.refit._fp8_layout import check_scheme, holds_cells, scale_layout, scale_name, values_layout
from warmlink.refit.families._model import LogicalModel, logical_model
from warmlink.refit.manifest import TensorLayout

__all__ = ["CONVENTIONS", "layouts", "logical_model", "LogicalModel", "fp8_weights"]

CONVENTIONS = ("hf", "vllm", "megatron")

# Roles of the weights vLLM's FP8 methods hold in FP8: its LinearBase layers and routed experts.
# Embeddings, the LM head, norms and routers stay in their dtype (DeepSeek-V3 builds its GateLinear
# without a quant_config; FP8 checkpoints keep lm_head and the gates out).
_FP8_ROLES = frozenset({"q", "k", "v", "o", "qkv", "gate", "up", "down", "gate_up", "mla_q_a", "mla_q_b", "mla_kv_a",
                        "mla_kv_b", "experts_gate_up", "experts_down"})


def fp8_weights(model_or_config: Any) -> frozenset[str]:
    """The logical weights an FP8 vLLM engine holds in FP8 (linear projections and routed experts;
    not embeddings, the LM head, norms, routers or biases): ``Fp8(logical=...)`` for a trainer.

    Raises:
        LayoutError: as ``layouts`` for a model it cannot read.
    """
    model = logical_model(model_or_config)
    return frozenset(t.name for t in model.tensors
                     if t.role in _FP8_ROLES and len(t.shape) >= 2 and not t.name.endswith(".bias"))


def _positive(func: str, **values: int) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LayoutError(f"{func}: {k}={v!r} invalid; expected an int >= 1")


def layouts(
    model_or_config: Any,
    *,
    convention: str,
    tp: int = 1,
    rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
    dtype: str | None = None,
    fp8: str | None = None,
    **options: Any,
) -> dict[str, TensorLayout]:
    """The tensors one rank of ``convention`` holds for this model, as layouts.

    Args:
        model_or_config: a transformers model or config (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE,
            Mixtral, DeepSeek-V3, Gemma 2/3, Phi-3, GPT-OSS, Mistral).
        convention: one of ``CONVENTIONS``; no default, nothing is guessed.
        tp: tensor-parallel size, ``>= 1``; ``rank``: this rank's index in it.
        ep: expert-parallel size for MoE experts, ``>= 1``; ``ep_rank``: this rank's index in it.
        dtype: wire dtype name for every tensor; default each logical tensor's own.
        options: convention-specific settings, each documented by its convention module
            (e.g. Megatron's ``make_vocab_size_divisible_by``); an unknown one is refused.

    Returns:
        Physical name -> ``TensorLayout``, a new dict the caller owns. Parts that the convention
        keeps on several ranks of the world described (GQA KV heads at ``tp > num_kv_heads``,
        data-parallel replicas) are marked replicated (Note [Replicated parts] in ``refit.manifest``).

    Raises:
        LayoutError: an unknown convention or option, sizes out of range, sizes the convention
            cannot shard, or a tensor no rule knows (named, with how to declare it by hand).

    **Collective?** No. **Blocking?** No (metadata only). **Warm path?** No: call once at setup.
    """
    if convention not in CONVENTIONS:
        raise LayoutError(f"families.layouts: convention={convention!r} is unknown; expected one of {list(CONVENTIONS)}")
    _positive("families.layouts", tp=tp, ep=ep)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise LayoutError(f"families.layouts: rank={rank!r} out of range; expected 0 <= rank < tp={tp}")
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < ep:
        raise LayoutError(f"families.layouts: ep_rank={ep_rank!r} out of range; expected 0 <= ep_rank < ep={ep}")
    model = logical_model(model_or_config, dtype)
    module = importlib.import_module(f"warmlink.refit.families.{convention}")
    out = module.layouts(model, tp=tp, rank=rank, ep=ep, ep_rank=ep_rank, **options)
    return out if fp8 is None else _with_fp8(out, fp8_weights(model_or_config), check_scheme(fp8, "families.layouts"))


def _with_fp8(out: dict[str, TensorLayout], weights: frozenset[str], scheme: str) -> dict[str, TensorLayout]:
    """``out`` with each tensor of ``weights`` as FP8 values, followed by its scales."""
    func = "families.layouts"
    fp8: dict[str, TensorLayout] = {}
    for name, layout in out.items():
        held = {p.logical for p in layout.parts}
        if not held & weights:
            fp8[name] = layout
            continue
        if held - weights:
            raise LayoutError(f"{func}: tensor {name!r} holds {sorted(held - weights)} beside FP8 weights; expected a "
                              "tensor of FP8 weights only")
        for p in layout.parts:
            if scheme == "block" and not holds_cells(p.shard.bounds, p.shard.global_shape, scheme):
                raise LayoutError(f"{func}: tensor {name!r} holds box={p.shard.bounds} of {p.logical!r} "
                                  f"{p.shard.global_shape}; expected cuts at multiples of 128 (vLLM: a partition "
                                  "not divisible by weight quantization block 128 is refused)")
        fp8[name] = values_layout(layout)
        fp8[scale_name(name, scheme)] = scale_layout(layout, scheme, func)
    return fp8
