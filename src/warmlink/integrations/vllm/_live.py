"""What a live vLLM worker holds, read from its modules and checked against warmlink's vLLM layouts.

# Note [Live vLLM layouts]
The live engine is the source of truth. For every tensor ``warmlink.refit.families.layouts(config,
convention="vllm", ...)`` names, the module that owns it is found in the worker's model and the
layout is built again from that module's own attributes: ``VocabParallelEmbedding`` /
``ParallelLMHead`` from ``shard_indices`` (the rows it loads), ``org_vocab_size``,
``num_embeddings_per_partition`` (its padding); ``QKVParallelLinear`` from ``tp_rank``,
``num_heads``, ``num_kv_heads``, ``head_size``, ``v_head_size``, ``num_kv_head_replicas``;
``MergedColumnParallelLinear`` from ``output_sizes`` and ``tp_rank`` / ``tp_size``;
``ColumnParallelLinear`` / ``RowParallelLinear`` from their partition sizes; ``RoutedExperts``
(FusedMoE) from its expert map (the local expert range) and its MoE TP rank and partition size
(GPT-OSS's ``GptOssRoutedExperts`` as its own loader places them: transposed weights, biases, a
zeroed ``w2_bias`` on MoE TP ranks > 0, Note [vLLM GPT-OSS]); GPT-OSS's ``OAIAttention`` sinks
from its ``qkv_proj``'s TP rank; norms and replicated linears whole. Only the logical names come
from the family rules (a module does not know transformers' names). The two must be equal, and the tensor's shape and dtype those
of the live parameter (before vLLM's post-processing: the shapes ``record_metadata_for_reloading``
kept at load); anything else is a ``LayoutError`` naming the tensor, the module's attributes and
both layouts, raised before any byte moves.

A module is installed in place when its kind is known, it is not quantized and its parameters are
still the tensors the layout describes, and the tensors its forward reads. Otherwise (a quantized
method, weights vLLM re-packed after loading, as its CPU backend does for every linear layer and
the LM head, whose ``cpu_linear`` computes with a packed copy, MoE experts of a backend that keeps
them in a kernel layout (CPU, FlashInfer, AITER; Triton computes with them as loaded), or a module
kind not read here) it is
*streamed*: each logical tensor feeding it is pulled, as much of it as the module's loader keeps
(the boxes above, in a tensor of the logical shape), and handed to ``model.load_weights`` under
vLLM's layerwise reload, which re-runs the module's post-processing (Note [Streaming receive]);
GPT-OSS experts one expert at a time, under vLLM's per-expert names (Note [Streaming GPT-OSS
experts]).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from warmlink._dtypes import dtype_name
from warmlink.errors import LayoutError
from warmlink.refit.manifest import Part, Shard, TensorLayout

__all__ = ["EngineLayouts", "read_engine"]


@dataclass
class EngineLayouts:
    """One worker's tensors, split by how they are installed.

    ``in_place``: vLLM parameter name -> (layout, the live tensor to copy into). ``streamed``:
    logical name -> layout of the logical shape holding the boxes the loader keeps. ``groups``:
    the logical names of each streamed module (handed in one ``load_weights`` call);
    ``reload_modules``: those modules by name; ``why``: module name -> why it is streamed;
    ``deferred``: logical names feeding a streamed module with padding, which vLLM's layerwise
    reload processes only at its end (they are handed as copies, not views of the buffer).
    """

    in_place: dict = field(default_factory=dict)
    streamed: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)
    reload_modules: dict = field(default_factory=dict)
    why: dict = field(default_factory=dict)
    deferred: set = field(default_factory=set)


def _vllm_kinds():
    from vllm.model_executor.layers import linear, vocab_parallel_embedding
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    # Most derived first: QKV and Merged are ColumnParallelLinears.
    kinds = ((linear.QKVParallelLinear, _qkv), (linear.MergedColumnParallelLinear, _merged),
             (linear.ColumnParallelLinear, _column), (linear.RowParallelLinear, _row),
             (linear.ReplicatedLinear, _whole), (vocab_parallel_embedding.VocabParallelEmbedding, _vocab),
             (RoutedExperts, _experts), (RMSNorm, _whole), (GemmaRMSNorm, _whole))
    oss = _gpt_oss()
    return kinds + ((oss.OAIAttention, _sinks),) if oss is not None else kinds


def _gpt_oss():
    """vLLM's GPT-OSS model module if a model of it was built in this process (never imported here)."""
    return sys.modules.get("vllm.model_executor.models.gpt_oss")


def _rows(shape, a: int, b: int) -> tuple:
    return ((a, b),) + tuple((0, d) for d in shape[1:])


# Each reader returns, for parameter ``leaf`` of ``m``: [(global_shape, bounds, offset)] per part,
# in the order vLLM places them, and the physical shape. ``shapes`` are the family's global shapes
# per part (the module's totals are checked against them by the layout comparison).
def _qkv(m, leaf, shapes):
    hs, vhs, nh, nkv = m.head_size, m.v_head_size, m.num_heads, m.num_kv_heads
    shard = m.tp_rank // m.num_kv_head_replicas
    rows = ((m.tp_rank * nh * hs, nh * hs), (shard * nkv * hs, nkv * hs), (shard * nkv * vhs, nkv * vhs))
    totals = (m.total_num_heads * hs, m.total_num_kv_heads * hs, m.total_num_kv_heads * vhs)
    tail = () if leaf == "bias" else (m.input_size,)
    parts, at = [], 0
    for (start, n), total in zip(rows, totals):
        g = (total,) + tail
        parts.append((g, _rows(g, start, start + n), (at,) + (0,) * len(tail)))
        at += n
    return parts, (at,) + tail


def _merged(m, leaf, shapes):
    tail = () if leaf == "bias" else (m.input_size,)
    parts, at = [], 0
    for total in m.output_sizes:
        per = total // m.tp_size
        g = (total,) + tail
        parts.append((g, _rows(g, m.tp_rank * per, (m.tp_rank + 1) * per), (at,) + (0,) * len(tail)))
        at += per
    return parts, (at,) + tail


def _column(m, leaf, shapes):
    per = m.output_size_per_partition
    tail = () if leaf == "bias" else (m.input_size,)
    g = (m.output_size,) + tail
    return [(g, _rows(g, m.tp_rank * per, (m.tp_rank + 1) * per), (0,) * len(g))], (per,) + tail


def _row(m, leaf, shapes):
    if leaf == "bias":  # added after the all-reduce: whole on every rank
        return [((m.output_size,), ((0, m.output_size),), (0,))], (m.output_size,)
    per = m.input_size_per_partition
    g = (m.output_size, m.input_size)
    return [(g, ((0, m.output_size), (m.tp_rank * per, (m.tp_rank + 1) * per)), (0, 0))], (m.output_size, per)


def _whole(m, leaf, shapes):
    g = tuple(shapes[0])
    return [(g, tuple((0, d) for d in g), (0,) * len(g))], g


def _vocab(m, leaf, shapes):
    if m.num_added_embeddings:
        raise LayoutError(f"vllm engine: {type(m).__name__} has num_added_embeddings={m.num_added_embeddings} (LoRA extra "
                          "vocabulary); expected 0 (warmlink refits the base vocabulary only)")
    si, h = m.shard_indices, m.embedding_dim
    g = (m.org_vocab_size, h)
    return [(g, _rows(g, si.org_vocab_start_index, si.org_vocab_end_index), (0, 0))], (m.num_embeddings_per_partition, h)


def _experts(m, leaf, shapes):
    if _is_oss_experts(m):
        return _oss_experts(m, leaf, _expert_range(m))
    first, last = _expert_range(m)
    num = m.global_num_experts
    mpc = m.moe_config.moe_parallel_config
    per, h = m.intermediate_size_per_partition, m.hidden_size
    inter = per * mpc.tp_size
    lo = mpc.tp_rank * per
    if leaf == "w2_weight":
        g = (num, h, inter)
        return [(g, ((first, last), (0, h), (lo, lo + per)), (0, 0, 0))], (last - first, h, per)
    g = (num, 2 * inter, h)
    if mpc.tp_size == 1:
        return [(g, ((first, last), (0, 2 * inter), (0, h)), (0, 0, 0))], (last - first, 2 * inter, h)
    return ([(g, ((first, last), (lo, lo + per), (0, h)), (0, 0, 0)),
             (g, ((first, last), (inter + lo, inter + lo + per), (0, h)), (0, per, 0))], (last - first, 2 * per, h))


def _expert_range(m) -> tuple[int, int]:
    """``[first, last)``: the global experts ``m`` holds, from its expert map."""
    import torch

    num = m.global_num_experts
    emap = getattr(m, "_expert_map", None)
    if emap is None:
        first, last = 0, num
    else:
        held = torch.nonzero(emap.cpu() != -1).flatten().tolist()
        first, last = (held[0], held[-1] + 1) if held else (0, 0)
        if held != list(range(first, last)) or emap.cpu()[first:last].tolist() != list(range(last - first)):
            raise LayoutError(f"vllm engine: {type(m).__name__} holds experts {held} (expert map); expected one contiguous "
                              "range in order (vLLM's 'linear' placement; 'round_robin' and EPLB are not supported)")
    return first, last


def _oss_experts(m, leaf, experts):
    """GPT-OSS's four expert tensors as ``GptOssModel._load_weights_other`` fills them (Note [vLLM
    GPT-OSS]): global shapes are transformers' (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``,
    biases ``[E, 2I]``, ``[E, H]``); the weights are held transposed, 4-tuples with their perm."""
    first, last = experts
    mpc = m.moe_config.moe_parallel_config
    num, per, h = m.global_num_experts, m.intermediate_size_per_partition, m.hidden_size
    inter, lo, n = per * mpc.tp_size, mpc.tp_rank * per, last - first
    if leaf == "w13_weight":
        g = (num, h, 2 * inter)
        return [(g, ((first, last), (0, h), (2 * lo, 2 * (lo + per))), (0, 0, 0), (0, 2, 1))], (n, 2 * per, h)
    if leaf == "w2_weight":
        g = (num, inter, h)
        return [(g, ((first, last), (lo, lo + per), (0, h)), (0, 0, 0), (0, 2, 1))], (n, h, per)
    if leaf == "w13_bias":
        g = (num, 2 * inter)
        return [(g, ((first, last), (2 * lo, 2 * (lo + per))), (0, 0))], (n, 2 * per)
    if leaf == "w2_bias":  # zeroed by the loader on MoE TP ranks > 0: added once before the all-reduce
        g = (num, h)
        return [(g, ((first, last) if mpc.tp_rank == 0 else (0, 0), (0, h)), (0, 0))], (n, h)
    raise LayoutError(f"vllm engine: {type(m).__name__} has no GPT-OSS expert tensor {leaf!r}; expected w13_weight, "
                      "w2_weight, w13_bias or w2_bias")


def _sinks(m, leaf, shapes):
    """GPT-OSS ``OAIAttention.sinks``: ``num_attention_heads // tp`` heads from ``tp_rank * that``,
    the TP rank and size of its own ``qkv_proj`` (the attention's TP group)."""
    qkv = m.qkv_proj
    per = m.num_attention_heads // qkv.tp_size
    return [((m.num_attention_heads,), ((qkv.tp_rank * per, (qkv.tp_rank + 1) * per),), (0,))], (per,)


_ATTRS = ("tp_rank", "tp_size", "num_heads", "num_kv_heads", "head_size", "num_kv_head_replicas", "output_sizes",
          "input_size", "output_size", "org_vocab_size", "num_embeddings_per_partition", "shard_indices",
          "global_num_experts", "intermediate_size_per_partition", "num_attention_heads")


def _attrs(m) -> dict:
    return {a: getattr(m, a) for a in _ATTRS if hasattr(m, a)}


def _original(module, leaf: str, live):
    """The tensor's shape and dtype as created, before vLLM's post-processing (CPU linears drop
    their weight after packing it): what ``record_metadata_for_reloading`` kept, else the live one."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - a vLLM without layerwise reload
        return tuple(live.shape), live.dtype
    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(leaf) if info is not None else None
    if meta is None and info is not None:
        meta = info.restore_metadata[1].get(leaf)
    return (tuple(meta.shape), meta.dtype) if meta is not None else (tuple(live.shape), live.dtype)


def _quantized(module) -> bool:
    method = getattr(module, "quant_method", None)
    return method is not None and not type(method).__name__.startswith("Unquantized")


# FusedMoE backends that compute with w13/w2 as loaded (``convert_to_unquantized_kernel_format``
# returns them unchanged); the others (CPU prepacking, FlashInfer, AITER shuffles) re-lay them.
_MOE_AS_LOADED = ("TRITON", "BATCHED_TRITON")


def _kernel_format(module) -> str | None:
    """Why ``module`` computes from another layout than the one it loaded, or None."""
    backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
    if backend is not None and getattr(backend, "name", None) not in _MOE_AS_LOADED:
        return f"its MoE backend {backend.name} keeps the experts in a kernel layout"
    sinks = getattr(module, "sinks", None)  # GPT-OSS: an attention backend may compute with a cast copy
    impl = getattr(getattr(module, "attn", None), "impl", None)
    if sinks is not None and impl is not None and getattr(impl, "sinks", sinks) is not sinks:
        return "its attention backend computes with a copy of sinks"
    return None


def read_engine(model, family: dict[str, TensorLayout], *, install: str = "auto") -> EngineLayouts:
    """Read ``model``'s modules, check ``family`` (``families.layouts(..., convention="vllm")`` of
    this rank) against them, and split the tensors into in-place and streamed (Note [Live vLLM layouts]).

    Args:
        model: the worker's model (``model_runner.model``).
        family: vLLM parameter name -> layout, from the family rules.
        install: ``"auto"`` (in place where possible), ``"stream"`` (every module through
            ``load_weights``) or ``"copy"`` (in place or refuse).

    Raises:
        LayoutError: a layout naming no live tensor, a live module whose attributes say other boxes,
            shape or dtype than the layout, a parameter of an in-place module that no layout names,
            or (``install="copy"``) a module that cannot be installed in place.
    """
    kinds = _vllm_kinds()
    by_module: dict[str, dict[str, TensorLayout]] = {}
    for phys, layout in family.items():
        mod_name, _, leaf = phys.rpartition(".")
        by_module.setdefault(mod_name, {})[leaf] = layout
    out = EngineLayouts()
    for mod_name, leaves in by_module.items():
        try:
            module = model.get_submodule(mod_name)
        except AttributeError:
            raise LayoutError(f"vllm engine: layout {mod_name}.{next(iter(leaves))!r} names module {mod_name!r}, which the "
                              f"live {type(model).__name__} does not have; expected vLLM's parameter names") from None
        reader = next((r for cls, r in kinds if isinstance(module, cls)), None)
        why = None if reader is not None else f"module kind {type(module).__name__} is not read by warmlink"
        verify = reader is not None and not _quantized(module)  # a quantized tensor is another shape
        if why is None and _quantized(module):
            why = f"quantized ({type(module.quant_method).__name__})"
        if why is None and hasattr(module, "cpu_linear"):
            why = "vLLM's CPU backend computes with a packed copy of its weight (cpu_linear)"
        if why is None:
            why = _kernel_format(module)
        targets = {}
        for leaf, layout in leaves.items():
            live = module._parameters.get(leaf)
            if live is None:
                live = module._buffers.get(leaf)
            if live is None:
                raise LayoutError(f"vllm engine: layout {layout.name!r} names no parameter or buffer {leaf!r} of the live "
                                  f"{type(module).__name__} {mod_name!r}; expected vLLM's parameter names")
            shape, dtype = _original(module, leaf, live)
            if verify:
                _check(module, mod_name, leaf, layout, reader, shape, dtype)
            if why is None and (tuple(live.shape) != shape or live.dtype != dtype or not live.is_contiguous()):
                why = f"{leaf} was re-made after loading (now {tuple(live.shape)} {dtype_name(live.dtype)})"
            targets[leaf] = live
        if why is None:
            extra = [n for n, p in module._parameters.items() if p is not None and n not in leaves]
            if extra:
                raise LayoutError(f"vllm engine: parameters {extra} of {mod_name!r} ({type(module).__name__}) are named by "
                                  "no layout; expected every parameter of an unquantized module to have one")
        if why is None and install != "stream":
            for leaf, layout in leaves.items():
                out.in_place[layout.name] = (layout, targets[leaf])
            continue
        if install == "copy":
            raise LayoutError(f"vllm engine: module {mod_name!r} cannot be installed in place ({why or 'install'}); "
                              "expected install='auto' or 'stream'")
        out.why[mod_name] = why or "install='stream'"
        out.reload_modules[mod_name] = module
        if _is_oss_experts(module):  # See Note [Streaming GPT-OSS experts]
            out.groups.append(_oss_streamed(out, module, mod_name, leaves))
            continue
        group = []
        for layout in leaves.values():
            # Unknown kinds: whole logical tensors (what the loader keeps is not known).
            for part in layout.parts if reader is not None else _wholes(layout):
                prev = out.streamed.get(part.logical)
                boxes = (prev.parts if prev is not None else ()) + (Part(part.logical, part.shard,
                                                                          tuple(b[0] for b in part.shard.bounds)),)
                out.streamed[part.logical] = TensorLayout(part.logical, layout.dtype, boxes, part.shard.global_shape)
                if part.logical not in group:
                    group.append(part.logical)
                if layout.is_padded:
                    out.deferred.add(part.logical)
        out.groups.append(group)
    return out


def _is_oss_experts(module) -> bool:
    oss = _gpt_oss()
    return oss is not None and isinstance(module, getattr(oss, "GptOssRoutedExperts", ()))


# Note [Streaming GPT-OSS experts]
# ``GptOssModel._load_weights_other`` writes transformers' whole expert tensors (``gate_up_proj``
# and the rest) with ``param.copy_``, past the weight loaders that vLLM's layerwise reload wraps:
# under that reload (how streamed modules are re-processed) those copies land in placeholders and
# the experts keep their old values, while ``load_weights`` reports them loaded (vLLM 0.32, seen on
# its CPU build). Its per-expert checkpoint names (``<layer>.mlp.experts.<e>.w13_weight``, ...)
# go through ``GptOssRoutedExperts.weight_loader`` instead, which the reload sees. So a streamed
# GPT-OSS experts module is handed one tensor per local expert and weight, in transformers'
# orientation (``[H, 2I]``, ``[I, H]``, ``[2I]``, ``[H]``) and full size, holding the box that
# loader keeps (it narrows by the MoE TP rank, transposes, and zeroes ``w2_bias`` on ranks > 0).
def _oss_streamed(out: EngineLayouts, module, mod_name: str, leaves: dict) -> list[str]:
    """Add the per-expert streamed layouts of a GPT-OSS experts module to ``out``; their names."""
    first, last = _expert_range(module)
    stem = mod_name.rpartition(".")[0]  # "<layer>.mlp.experts"
    group = []
    for leaf, layout in leaves.items():
        (part,) = layout.parts
        g = part.shard.global_shape
        rest = part.shard.bounds[1:] if part.shard.numel else tuple((0, 0) for _ in g[1:])
        for e in range(first, last):
            name = f"{stem}.{e}.{leaf}"
            box = Part(part.logical, Shard(g, ((e, e + 1),) + rest), tuple(a for a, _ in rest))
            out.streamed[name] = TensorLayout(name, layout.dtype, (box,), g[1:])
            group.append(name)
    return group


def _wholes(layout: TensorLayout) -> list[Part]:
    seen = {}
    for p in layout.parts:
        seen.setdefault(p.logical, Part(p.logical, Shard(p.shard.global_shape)))
    return list(seen.values())


def _check(module, mod_name: str, leaf: str, layout: TensorLayout, reader, shape, dtype) -> None:
    """The layout built from ``module``'s attributes must equal ``layout`` (Note [Live vLLM layouts])."""
    try:
        parts, phys = reader(module, leaf, [p.shard.global_shape for p in layout.parts])
        live = None
        if len(parts) == len(layout.parts):
            live = TensorLayout(layout.name, dtype_name(dtype),
                                tuple(Part(p.logical, Shard(g, b), o, perm[0] if perm else None)
                                      for p, (g, b, o, *perm) in zip(layout.parts, parts)),  # perm: transposed parts
                                tuple(phys))
    except (AttributeError, TypeError, LayoutError) as exc:
        if isinstance(exc, LayoutError) and "vllm engine" in str(exc):
            raise
        raise LayoutError(f"vllm engine: {layout.name!r}: the live {type(module).__name__} {mod_name!r} does not describe "
                          f"its layout ({type(exc).__name__}: {exc}); attributes {_attrs(module)}") from None
    if live != layout or tuple(shape) != layout.shape:
        raise LayoutError(
            f"vllm engine: {layout.name!r}: the live {type(module).__name__} {mod_name!r} (attributes {_attrs(module)}, "
            f"tensor {tuple(shape)} {dtype_name(dtype)}) holds {_describe(live)}; warmlink's vLLM layout says "
            f"{_describe(layout)}; expected equal (a vLLM version whose layers differ from Note [vLLM layouts])")


def _describe(layout: TensorLayout | None) -> str:
    if layout is None:
        return "another number of parts"
    return (f"{layout.dtype} {layout.shape} = " +
            "; ".join(f"{p.logical}{list(p.shard.bounds)} at {p.offset}" + (f" transposed {p.perm}" if p.perm else "")
                      for p in layout.parts))
