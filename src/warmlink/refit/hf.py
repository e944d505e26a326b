"""Tensor-parallel layouts of Hugging Face Llama / Qwen2 style models, and slicing into them.

``tp_layouts`` says, for every parameter of a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (or
``MistralForCausalLM``), which block a Megatron / vLLM tensor-parallel rank holds; ``shard_state`` and
``shard_into`` cut those blocks out of a full (unsharded) state dict. Logical names are always the
HF parameter names, so a fused publisher (vLLM ``qkv_proj`` / ``gate_up_proj``) and an unfused
receiver plan against each other.

# Note [HF tensor-parallel rules]
As Megatron-LM and vLLM lay them out, with ``tp`` ranks and this rank ``rank``:

- ``embed_tokens.weight``, ``lm_head.weight``: vocab-parallel, split dim 0 ``tp`` ways. Uneven
  splits follow ``manifest.split_bounds`` (no vocab padding). With ``tie_word_embeddings`` the
  head *is* the embedding Parameter, so only ``embed_tokens.weight`` is listed.
- ``q_proj``: column-parallel by heads (dim 0); ``num_attention_heads % tp == 0``.
- ``k_proj`` / ``v_proj``: column-parallel by KV heads. ``tp <= num_kv``: ``num_kv % tp == 0``,
  shard ``rank`` of ``tp``. ``tp > num_kv`` (GQA replication): ``tp % num_kv == 0`` and the rank
  holds KV head block ``rank * num_kv // tp`` of ``num_kv``; several ranks hold the same block.
- ``gate_proj`` / ``up_proj``: column-parallel (dim 0); ``intermediate_size % tp == 0``.
- ``o_proj`` / ``down_proj`` weights: row-parallel (dim 1), same divisibility as their inputs.
- Biases of column-parallel layers (Qwen2's q/k/v, Llama's ``attention_bias`` / ``mlp_bias``)
  split like their weights; biases of row-parallel layers and all norms are replicated.
- ``fused=True``: ``<layer>.self_attn.qkv_proj.{weight,bias}`` = ``[q; k; v]`` and
  ``<layer>.mlp.gate_up_proj.{weight,bias}`` = ``[gate; up]``, concatenated along dim 0 per rank.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from warmlink._dtypes import dtype_name, dtype_size
from warmlink.errors import LayoutError
from warmlink.refit.manifest import Part, Shard, TensorLayout

__all__ = ["tp_layouts", "shard_state", "shard_into"]

_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ATTN_RE = re.compile(r"^(?P<prefix>.*)\.self_attn\.(?P<proj>[qkvo])_proj\.(?P<kind>weight|bias)$")
_MLP_RE = re.compile(r"^(?P<prefix>.*)\.mlp\.(?P<proj>gate|up|down)_proj\.(?P<kind>weight|bias)$")
_FUSED_GROUPS = {"q": ("qkv", "self_attn", "qkv_proj"), "k": ("qkv", "self_attn", "qkv_proj"),
                 "v": ("qkv", "self_attn", "qkv_proj"), "gate": ("gate_up", "mlp", "gate_up_proj"),
                 "up": ("gate_up", "mlp", "gate_up_proj")}
_FUSED_MEMBERS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


# -- config / model inspection -------------------------------------------------------------------
def _is_model(obj: Any) -> bool:
    return hasattr(obj, "named_parameters") and hasattr(obj, "config")


def _config_int(config: Any, field: str) -> int:
    value = getattr(config, field, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"tp_layouts: config.{field}={value!r} is missing or invalid; expected a positive int")
    return value


def _config_dtype(config: Any) -> str:
    """Wire dtype name from ``config.dtype`` (transformers >= 4.56) or ``config.torch_dtype``."""
    value = getattr(config, "dtype", None)
    if value is None:
        # Read the instance dict: on transformers 5 ``torch_dtype`` is a deprecated property that logs.
        value = vars(config).get("torch_dtype") if hasattr(config, "__dict__") else None
    if value is None or value == "auto":
        return "float32"
    return dtype_name(value)


class _Dims:
    """The sizes the TP rules need, read once from a transformers config."""

    def __init__(self, config: Any) -> None:
        self.hidden = _config_int(config, "hidden_size")
        self.num_layers = _config_int(config, "num_hidden_layers")
        self.num_heads = _config_int(config, "num_attention_heads")
        has_kv = getattr(config, "num_key_value_heads", None) is not None
        self.num_kv = _config_int(config, "num_key_value_heads") if has_kv else self.num_heads
        head_dim = getattr(config, "head_dim", None)
        self.head_dim = head_dim if head_dim is not None else self.hidden // self.num_heads
        self.intermediate = _config_int(config, "intermediate_size")
        self.vocab = _config_int(config, "vocab_size")
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model_type = getattr(config, "model_type", None)


def _check_model_type(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise LayoutError(
            f"tp_layouts: config.model_type={model_type!r} is not supported; expected one of "
            f"{_SUPPORTED_MODEL_TYPES} (or pass the model itself to read its parameter names)"
        )


def _config_shapes(config: Any, dims: _Dims) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, in ``named_parameters()`` order, synthesised from ``config``."""
    qkv_bias = dims.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    o_bias = dims.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    h, q_out, kv_out, inter = dims.hidden, dims.num_heads * dims.head_dim, dims.num_kv * dims.head_dim, dims.intermediate
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (dims.vocab, h)}
    for i in range(dims.num_layers):
        p = f"model.layers.{i}"
        for proj, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[f"{p}.self_attn.{proj}_proj.weight"] = (out, h)
            if qkv_bias:
                shapes[f"{p}.self_attn.{proj}_proj.bias"] = (out,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q_out)
        if o_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
        for proj, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
            shapes[f"{p}.mlp.{proj}_proj.weight"] = shape
            if mlp_bias:
                shapes[f"{p}.mlp.{proj}_proj.bias"] = (shape[0],)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not dims.tied:
        shapes["lm_head.weight"] = (dims.vocab, h)
    return shapes


# -- per-parameter rules -------------------------------------------------------------------------
def _divisible(what: str, size: int, tp: int) -> None:
    if size % tp != 0:
        raise LayoutError(
            f"tp_layouts: {what}={size} is not divisible by tp={tp}; expected tp to divide {what} "
            f"(choose tp in {[d for d in range(1, size + 1) if size % d == 0]})"
        )


def _kv_split(dims: _Dims, tp: int, rank: int) -> tuple[int, int]:
    """``(num_shards, shard_idx)`` of the KV heads this rank holds. See Note [HF tensor-parallel rules]."""
    if tp <= dims.num_kv:
        _divisible("num_key_value_heads", dims.num_kv, tp)
        return tp, rank
    if tp % dims.num_kv != 0:
        raise LayoutError(
            f"tp_layouts: tp={tp} > num_key_value_heads={dims.num_kv} but is not a multiple of it; "
            "expected tp % num_key_value_heads == 0 so that each KV head is replicated evenly"
        )
    return dims.num_kv, rank * dims.num_kv // tp


def _shard_for(name: str, shape: tuple[int, ...], dims: _Dims, tp: int, rank: int) -> Shard:
    """The block of parameter ``name`` (global ``shape``) that TP rank ``rank`` of ``tp`` holds."""
    if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
        if shape[0] < tp:
            raise LayoutError(
                f"tp_layouts: vocab_size={shape[0]} of {name!r} cannot be split tp={tp} ways without an "
                "empty shard; expected vocab_size >= tp"
            )
        return Shard.split(shape, 0, tp, rank)
    m = _ATTN_RE.match(name)
    if m is not None:
        proj, kind = m["proj"], m["kind"]
        if proj == "q":
            return Shard.split(shape, 0, tp, rank)
        if proj in ("k", "v"):
            num_shards, shard_idx = _kv_split(dims, tp, rank)
            return Shard.split(shape, 0, num_shards, shard_idx)
        return Shard.split(shape, 1, tp, rank) if kind == "weight" else Shard(shape)
    m = _MLP_RE.match(name)
    if m is not None:
        proj, kind = m["proj"], m["kind"]
        if proj in ("gate", "up"):
            return Shard.split(shape, 0, tp, rank)
        return Shard.split(shape, 1, tp, rank) if kind == "weight" else Shard(shape)
    if name.endswith("norm.weight") or name.endswith("norm.bias"):
        return Shard(shape)
    raise LayoutError(
        f"tp_layouts: parameter {name!r} (shape {shape}) has no tensor-parallel rule; expected a "
        "Llama / Qwen2 parameter (embed_tokens, q/k/v/o_proj, gate/up/down_proj, *norm, lm_head)"
    )


def _fuse(plain: dict[str, TensorLayout]) -> dict[str, TensorLayout]:
    """Replace q/k/v and gate/up layouts by vLLM's fused ``qkv_proj`` / ``gate_up_proj``."""
    groups: dict[str, tuple[str, dict[str, TensorLayout]]] = {}
    order: list[tuple[str, TensorLayout | None]] = []
    for name, layout in plain.items():
        m = _ATTN_RE.match(name) or _MLP_RE.match(name)
        fused = _FUSED_GROUPS.get(m["proj"]) if m is not None else None
        if fused is None:
            order.append((name, layout))
            continue
        group, module, fused_proj = fused
        fused_name = f"{m['prefix']}.{module}.{fused_proj}.{m['kind']}"
        if fused_name not in groups:
            groups[fused_name] = (group, {})
            order.append((fused_name, None))
        groups[fused_name][1][m["proj"]] = layout
    out: dict[str, TensorLayout] = {}
    for name, layout in order:
        if layout is not None:
            out[name] = layout
            continue
        group, members = groups[name]
        wanted = _FUSED_MEMBERS[group]
        missing = [p for p in wanted if p not in members]
        if missing:
            raise LayoutError(
                f"tp_layouts: fused {name!r} lacks {missing}; expected all of {list(wanted)} (use fused=False)"
            )
        dtypes = {members[p].dtype for p in wanted}
        if len(dtypes) != 1:
            raise LayoutError(f"tp_layouts: fused {name!r} members have dtypes {sorted(dtypes)}; expected one dtype")
        parts = [(members[p].parts[0].logical, members[p].parts[0].shard) for p in wanted]
        out[name] = TensorLayout.fused(name, dtypes.pop(), parts, fuse_dim=0)
    return out


# -- public API ----------------------------------------------------------------------------------
def tp_layouts(
    model_or_config: Any,
    *,
    tp: int,
    rank: int,
    dtype: str | None = None,
    fused: bool = False,
) -> dict[str, TensorLayout]:
    """Layouts a Megatron / vLLM tensor-parallel rank holds for a Llama / Qwen2 model.

    See Note [HF tensor-parallel rules].

    Args:
        model_or_config: a ``transformers`` config (``LlamaConfig``, ``Qwen2Config``,
            ``MistralConfig``) or a model (``...ForCausalLM``); with a model, parameter names and
            shapes come from ``named_parameters()`` (tied weights listed once), head counts from
            ``model.config``.
        tp: tensor-parallel size, ``>= 1``.
        rank: this rank's index in the TP group, ``0 <= rank < tp``.
        dtype: wire dtype name (``"bfloat16"``) for every tensor; by default each parameter's own
            dtype (model) or ``config.dtype`` / ``config.torch_dtype``, else ``"float32"`` (config).
        fused: emit vLLM's fused ``qkv_proj`` / ``gate_up_proj`` physical tensors.

    Returns:
        Physical name -> ``TensorLayout``, in parameter order; a new dict the caller owns. Logical
        names are the HF parameter names (``model.layers.0.self_attn.q_proj.weight``).

    Raises:
        LayoutError: ``tp`` / ``rank`` out of range, ``tp`` not dividing the heads, KV heads or
            ``intermediate_size``, vocab smaller than ``tp``, an unsupported model type or a
            parameter without a rule.
        MetadataError: an unknown ``dtype`` name.

    **Collective?** No. **Blocking?** No (pure metadata, touches no tensor memory).
    **Warm path?** Not for the warm path: call once at setup.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise LayoutError(f"tp_layouts: tp={tp!r} is invalid; expected an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise LayoutError(f"tp_layouts: rank={rank!r} out of range; expected 0 <= rank < tp={tp}")
    if dtype is not None:
        dtype_size(dtype)
    is_model = _is_model(model_or_config)
    config = model_or_config.config if is_model else model_or_config
    if not is_model:
        _check_model_type(config)
    dims = _Dims(config)
    _divisible("num_attention_heads", dims.num_heads, tp)
    _kv_split(dims, tp, rank)
    _divisible("intermediate_size", dims.intermediate, tp)
    if is_model:
        params = dict(model_or_config.named_parameters())
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        dtypes = {name: dtype if dtype is not None else dtype_name(p.dtype) for name, p in params.items()}
    else:
        shapes = _config_shapes(config, dims)
        default = dtype if dtype is not None else _config_dtype(config)
        dtypes = dict.fromkeys(shapes, default)
    plain = {
        name: TensorLayout(name, dtypes[name], (Part(name, _shard_for(name, shape, dims, tp, rank)),))
        for name, shape in shapes.items()
    }
    return _fuse(plain) if fused else plain


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def _check_source(state: Mapping[str, Any], layouts: Mapping[str, TensorLayout], func: str) -> None:
    for name, layout in layouts.items():
        for part in layout.parts:
            if part.logical not in state:
                raise LayoutError(
                    f"{func}: logical tensor {part.logical!r} (needed by {name!r}) is missing from state; "
                    "expected a full state dict with HF parameter names"
                )
            have = tuple(state[part.logical].shape)
            if have != part.shard.global_shape:
                raise LayoutError(
                    f"{func}: state[{part.logical!r}].shape={have} does not match the layout's global_shape="
                    f"{part.shard.global_shape} (tensor {name!r}); expected the full, unsharded tensor"
                )


def _copy_parts(state: Mapping[str, Any], layout: TensorLayout, dst: Any) -> None:
    for part in layout.parts:
        target = dst[_slices(part.local_box())]
        target.copy_(state[part.logical].detach()[_slices(part.shard.bounds)].reshape(target.shape))


def shard_state(state: Mapping[str, Any], layouts: Mapping[str, TensorLayout]) -> dict[str, Any]:
    """Build each physical tensor of ``layouts`` from the full logical tensors in ``state``.

    Each part's box is sliced out of ``state[part.logical]`` and the parts are concatenated along
    ``fuse_dim``, cast to the layout's dtype.

    Args:
        state: HF parameter name -> full (unsharded) tensor, any device; extra keys are ignored.
        layouts: physical name -> layout, e.g. from ``tp_layouts``.

    Returns:
        Physical name -> a NEW contiguous tensor of shape ``layout.local_shape`` and the layout's
        dtype, on the device of its first part's source tensor; the caller owns it. Ready on the
        current stream of that device.

    Raises:
        LayoutError: a logical tensor missing from ``state`` or of the wrong global shape (checked
            for every layout before anything is allocated).

    **Collective?** No. **Blocking?** No host sync beyond what the copies imply.
    **Warm path?** No: allocates every tensor; use ``shard_into`` on the warm path.
    """
    import torch

    from warmlink._dtypes import torch_dtype

    _check_source(state, layouts, "shard_state")
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, layout in layouts.items():
            device = state[layout.parts[0].logical].device
            dst = torch.empty(layout.local_shape, dtype=torch_dtype(layout.dtype), device=device)
            _copy_parts(state, layout, dst)
            out[name] = dst
    return out


def shard_into(
    state: Mapping[str, Any],
    layouts: Mapping[str, TensorLayout],
    out: Mapping[str, Any],
) -> None:
    """Like ``shard_state`` but copies into the existing tensors ``out[name]`` in place.

    For a trainer that refreshes its published shards after every optimizer step.

    Args:
        state: HF parameter name -> full (unsharded) tensor; extra keys are ignored.
        layouts: physical name -> layout.
        out: physical name -> destination tensor of shape ``layout.local_shape`` and the layout's
            dtype, owned by the caller (may be a published Parameter; written under ``no_grad``).

    Raises:
        LayoutError: a logical tensor missing from ``state`` or misshapen, or a destination missing,
            misshapen or of another dtype (all checked before any byte is copied).

    **Collective?** No. **Blocking?** No: copies are queued on the current stream.
    **Warm path?** Yes: allocates, registers and plans nothing.
    """
    import torch

    _check_source(state, layouts, "shard_into")
    for name, layout in layouts.items():
        if name not in out:
            raise LayoutError(f"shard_into: out[{name!r}] is missing; expected a tensor of shape {layout.local_shape}")
        dst = out[name]
        if tuple(dst.shape) != layout.local_shape or dtype_name(dst.dtype) != layout.dtype:
            raise LayoutError(
                f"shard_into: out[{name!r}] is {tuple(dst.shape)} {dtype_name(dst.dtype)}; expected "
                f"{layout.local_shape} {layout.dtype}"
            )
    with torch.no_grad():
        for name, layout in layouts.items():
            _copy_parts(state, layout, out[name])
