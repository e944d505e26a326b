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
"""

from __future__ import annotations

import importlib
from typing import Any

from warmlink.errors import LayoutError
from warmlink.refit.families._model import LogicalModel, logical_model
from warmlink.refit.manifest import TensorLayout

__all__ = ["CONVENTIONS", "layouts", "logical_model", "LogicalModel"]

CONVENTIONS = ("hf", "vllm", "megatron")


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
    return module.layouts(model, tp=tp, rank=rank, ep=ep, ep_rank=ep_rank, **options)
