"""The logical model of a Hugging Face architecture: every tensor, its shape and what it is.

Logical tensors are the parameters and persistent buffers of the ``transformers`` model itself,
with its names and shapes (transformers 5 stores MoE experts as 3-D ``experts.gate_up_proj``
``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``; that is the logical form here too). From a
config the model is built on the meta device, so names and shapes come from transformers' own code,
not from a restatement of it, and no memory is allocated. Each tensor gets a *role* (what the
conventions need to know to shard it) from its name; a tensor no rule knows is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from warmlink._dtypes import dtype_name
from warmlink.errors import LayoutError

__all__ = ["Logical", "Dims", "LogicalModel", "logical_model", "ROLES"]

# name suffix (after "model.layers.{i}." or at top level) -> role. First match wins.
_RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "embed"),
    (r"lm_head\.weight", "lm_head"),
    (r"model\.norm\.weight", "norm"),
    (r".*(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)\.weight", "norm"),
    (r"self_attn\.(q_norm|k_norm)\.weight", "norm"),
    (r"self_attn\.q_proj\.(weight|bias)", "q"),
    (r"self_attn\.k_proj\.(weight|bias)", "k"),
    (r"self_attn\.v_proj\.(weight|bias)", "v"),
    (r"self_attn\.o_proj\.weight", "o"),
    (r"self_attn\.o_proj\.bias", "o_bias"),
    (r"self_attn\.qkv_proj\.(weight|bias)", "qkv"),  # Phi-3: HF fuses [q; k; v] itself
    (r"self_attn\.sinks", "sinks"),  # GPT-OSS: one per query head
    (r"self_attn\.q_a_proj\.weight", "mla_q_a"),
    (r"self_attn\.q_a_layernorm\.weight", "norm"),
    (r"self_attn\.q_b_proj\.weight", "mla_q_b"),
    (r"self_attn\.kv_a_proj_with_mqa\.weight", "mla_kv_a"),
    (r"self_attn\.kv_a_layernorm\.weight", "norm"),
    (r"self_attn\.kv_b_proj\.weight", "mla_kv_b"),
    (r"mlp\.(shared_experts\.)?gate_proj\.(weight|bias)", "gate"),
    (r"mlp\.(shared_experts\.)?up_proj\.(weight|bias)", "up"),
    (r"mlp\.(shared_experts\.)?down_proj\.weight", "down"),
    (r"mlp\.(shared_experts\.)?down_proj\.bias", "down_bias"),
    (r"mlp\.gate_up_proj\.(weight|bias)", "gate_up"),  # Phi-3: HF fuses [gate; up] itself
    (r"mlp\.experts\.gate_up_proj", "experts_gate_up"),  # [E, 2I, H], [gate; up] along dim 1
    (r"mlp\.experts\.down_proj", "experts_down"),  # [E, H, I]
    (r"mlp\.experts\.gate_up_proj_bias", "experts_gate_up_bias"),  # GPT-OSS: [E, 2I] interleaved
    (r"mlp\.experts\.down_proj_bias", "experts_down_bias"),  # GPT-OSS: [E, H]
    (r"mlp\.gate\.weight", "router"),
    (r"mlp\.router\.weight", "router"),
    (r"mlp\.router\.bias", "router_bias"),
    (r"mlp\.gate\.e_score_correction_bias", "router_bias"),  # DeepSeek-V3: a trained buffer
)

#: Roles, and what each holds. Conventions map every role to a physical layout.
ROLES = {
    "embed": "[vocab, hidden] token embedding",
    "lm_head": "[vocab, hidden] output projection",
    "norm": "a replicated vector (RMSNorm weights, q/k norms)",
    "q": "query projection [heads * head_dim, hidden] (or its bias)",
    "k": "key projection [kv_heads * head_dim, hidden] (or its bias)",
    "v": "value projection [kv_heads * head_dim, hidden] (or its bias)",
    "o": "attention output [hidden, heads * head_dim]",
    "o_bias": "attention output bias [hidden]",
    "qkv": "HF-fused [q; k; v] (Phi-3)",
    "sinks": "attention sinks [heads]",
    "mla_q_a": "MLA query down-projection [q_lora_rank, hidden]",
    "mla_q_b": "MLA query up-projection [heads * qk_head_dim, q_lora_rank]",
    "mla_kv_a": "MLA joint KV down-projection with the rope key [kv_lora_rank + rope_dim, hidden]",
    "mla_kv_b": "MLA KV up-projection [heads * (nope_dim + v_dim), kv_lora_rank]",
    "gate": "MLP gate projection [intermediate, hidden] (or its bias)",
    "up": "MLP up projection [intermediate, hidden] (or its bias)",
    "down": "MLP down projection [hidden, intermediate]",
    "down_bias": "MLP down bias [hidden]",
    "gate_up": "HF-fused [gate; up] (Phi-3)",
    "experts_gate_up": "experts [E, 2I, H] ([gate; up] along dim 1), or GPT-OSS [E, H, 2I] interleaved",
    "experts_down": "experts [E, H, I], or GPT-OSS [E, I, H]",
    "experts_gate_up_bias": "GPT-OSS experts' gate/up bias [E, 2I], interleaved",
    "experts_down_bias": "GPT-OSS experts' down bias [E, H]",
    "router": "router weight [E, hidden]",
    "router_bias": "router bias or score correction [E]",
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_COMPILED = tuple((re.compile(pattern + r"$"), role) for pattern, role in _RULES)


@dataclass(frozen=True)
class Logical:
    """One logical tensor: its HF name, global shape, dtype name and role."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    layer: int | None
    buffer: bool


@dataclass(frozen=True)
class Dims:
    """The sizes conventions need, read from the config (``None`` where the family has none)."""

    model_type: str
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int | None
    tied: bool
    interleaved_experts: bool  # GPT-OSS: [E, H, 2I] with gate/up alternating along the last dim
    # Sizes below are None where the family has none; convention modules check their divisibility.
    intermediate: int | None = None  # dense MLP intermediate_size
    moe_intermediate: int | None = None  # one expert's intermediate size
    num_shared_experts: int | None = None  # DeepSeek n_shared_experts
    q_lora_rank: int | None = None  # MLA
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None


@dataclass(frozen=True)
class LogicalModel:
    """Every logical tensor of one model, in ``named_parameters`` order, then persistent buffers."""

    config: Any
    dims: Dims
    tensors: tuple[Logical, ...]
    # transformers' own parallel plans for this model (``model.tp_plan`` / ``model.ep_plan``: module
    # or parameter name with ``*`` for layer numbers -> style name); empty where it has none.
    tp_plan: dict[str, str] = field(default_factory=dict, compare=False)
    ep_plan: dict[str, str] = field(default_factory=dict, compare=False)

    def by_role(self, role: str) -> list[Logical]:
        return [t for t in self.tensors if t.role == role]


def _role(name: str) -> str | None:
    m = _LAYER.match(name)
    rest = m.group(2) if m else name
    for pattern, role in _COMPILED:
        if pattern.match(rest) or pattern.match(name):
            return role
    return None


def _int(config: Any, *fields: str, default: int | None = None) -> int | None:
    for f in fields:
        value = getattr(config, f, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _dims(config: Any) -> Dims:
    text = getattr(config, "text_config", None)
    config = text if text is not None and getattr(config, "hidden_size", None) is None else config
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    if hidden is None or heads is None:
        raise LayoutError(f"families: config {type(config).__name__} has no hidden_size / num_attention_heads; "
                          "expected a transformers decoder config")
    num_experts = _int(config, "num_experts", "num_local_experts", "n_routed_experts")
    return Dims(
        model_type=str(getattr(config, "model_type", "?")),
        hidden=hidden,
        vocab=_int(config, "vocab_size"),
        num_heads=heads,
        num_kv_heads=_int(config, "num_key_value_heads", default=heads),
        head_dim=_int(config, "head_dim", default=hidden // heads),
        num_experts=num_experts,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        interleaved_experts=getattr(config, "model_type", None) == "gpt_oss",
        intermediate=_int(config, "intermediate_size"),
        # Mixtral and GPT-OSS experts use intermediate_size itself
        moe_intermediate=None if num_experts is None else _int(config, "moe_intermediate_size", "intermediate_size"),
        num_shared_experts=_int(config, "n_shared_experts"),
        q_lora_rank=_int(config, "q_lora_rank"),
        kv_lora_rank=_int(config, "kv_lora_rank"),
        qk_nope_head_dim=_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(config, "qk_rope_head_dim"),
        v_head_dim=_int(config, "v_head_dim"),
    )


def _meta_model(config: Any):
    """The transformers model of ``config`` on the meta device: names and shapes, no memory."""
    import torch

    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # an optional dependency: say which
        raise LayoutError(f"families: reading a config needs transformers ({e}); pass the model itself instead") from None
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError) as e:
            raise LayoutError(f"families: transformers cannot build model_type="
                              f"{getattr(config, 'model_type', None)!r} ({e})") from None


def logical_model(model_or_config: Any, dtype: str | None = None) -> LogicalModel:
    """The logical model of a transformers model or config.

    Args:
        model_or_config: a ``PreTrainedModel`` (its own tensors are read) or a ``PretrainedConfig``
            (the model is built on the meta device).
        dtype: wire dtype for every tensor; default each tensor's own (a config's ``dtype``).

    Raises:
        LayoutError: a tensor no role rule knows (named, with how to declare it by hand).
    """
    from warmlink.refit._declare import module_tensors

    is_model = hasattr(model_or_config, "named_parameters") and hasattr(model_or_config, "config")
    config = model_or_config.config if is_model else model_or_config
    model = model_or_config if is_model else _meta_model(config)
    if not is_model and dtype is None:
        cfg_dtype = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
        dtype = dtype_name(cfg_dtype) if cfg_dtype not in (None, "auto") else None
    params = dict(model.named_parameters())
    out = []
    for name, t in module_tensors(model).items():
        role = _role(name)
        if role is None:
            raise LayoutError(
                f"families: tensor {name!r} (shape {tuple(t.shape)}) of {type(model).__name__} has no rule; expected one "
                f"of the roles {sorted(ROLES)} (declare it by hand with TensorLayout, or add a rule in "
                "warmlink.refit.families._model)"
            )
        m = _LAYER.match(name)
        out.append(Logical(name, tuple(t.shape), dtype or dtype_name(t.dtype), role,
                           int(m.group(1)) if m else None, name not in params))
    return LogicalModel(config, _dims(config), tuple(out), _plan(model, "tp_plan"), _plan(model, "ep_plan"))


def _plan(model: Any, which: str) -> dict[str, str]:
    """``model.tp_plan`` / ``model.ep_plan`` as transformers resolved them for this model class and
    config (``PreTrainedModel.init_parallel_plans``); empty for a model without one."""
    plan = getattr(model, which, None)
    if plan is None:
        plan = getattr(model, f"_{which}", None)
    return {str(k): str(v) for k, v in dict(plan or {}).items()}
