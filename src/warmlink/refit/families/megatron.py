"""Megatron-core's layouts: what one rank of a Megatron-core ``GPTModel`` holds, under its own names.

``layouts(model, tp=..., rank=..., ep=..., ep_rank=...)`` gives, for one rank, every tensor of the
``GPTModel`` that Megatron-core 0.16 builds from ``get_gpt_layer_local_spec`` (its own modules, no
Transformer Engine; ``spec="te"`` gives the Transformer Engine spec's names for dense models),
with pipeline size 1, as boxes of the Hugging Face logical tensors
(``families._model``). The rules are in Note [Megatron layouts]; each mirrors the megatron-core
function it names, and ``tests/refit/test_megatron_core.py`` checks them against that code running
on CPU.

Families: Llama 3, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k layernorm), Qwen3-MoE and Mixtral
(experts), DeepSeek-V3 (multi-latent attention, shared experts, routed experts with a score
correction bias). Any other ``model_type`` is refused by name: the same bytes can mean something
else there (Gemma's norms are stored as ``w`` and applied as ``1 + w``).

# Note [Megatron layouts]
``tp`` ranks, this one ``rank``; ``divide`` is ``megatron.core.utils.divide``, which refuses a
remainder, so every size below that Megatron divides must divide evenly (else ``LayoutError``).

* Column-parallel (``ColumnParallelLinear``: ``output_size_per_partition = divide(out, tp)``): rank
  ``r`` holds rows ``[r * out / tp, (r + 1) * out / tp)`` of the full weight and bias. Row-parallel
  (``RowParallelLinear``): the same along the input dimension (dim 1); its bias is whole on every rank.
* QKV (``SelfAttention``): ``get_query_key_value_tensors`` views ``linear_qkv``'s output as
  ``[ng, (np / ng + 2) * hn]``: for query group ``g``, its ``np / ng`` query heads, then its key
  head, then its value head. That interleaved tensor is column-split. With ``ng >= tp`` a rank holds
  the whole groups ``[r * ng / tp, (r + 1) * ng / tp)``. With ``ng < tp`` (``Attention.__init__``
  sets ``num_query_groups_per_partition = 1``) a rank holds ``1 / tp`` of the rows, which can cut a
  group anywhere; Megatron all-gathers them (``all_gather_last_dim_from_tensor_parallel_region``)
  and keeps its own ``np / tp`` query heads. Each rank's tensor is the boxes of q, k and v (and
  their biases) those rows cover. Refused: ``np % tp``, ``ng % tp`` when ``ng >= tp`` and
  ``tp % ng`` when ``ng < tp`` (Megatron would index heads past its own).
* ``linear_fc1`` with ``gated_linear_unit`` is built with ``stride=2`` (``MLP.__init__``) and its
  ``glu`` splits the output with ``torch.chunk(x, 2, dim=-1)``: rank ``r`` holds
  ``[gate_r; up_r]``, gate and up each cut ``tp`` ways. Refused: ``intermediate % tp`` (``divide``
  would pass ``2 * intermediate / tp`` and the chunk would mix gate and up rows).
* Vocabulary (``VocabParallelEmbedding``, ``output_layer``): the vocabulary is padded to a multiple
  of ``make_vocab_size_divisible_by * tp``: ``ceil(V / multiple) * multiple``, which is
  ``_vocab_size_with_padding`` in ``megatron/training/tokenizer/tokenizer.py`` (Megatron-LM's
  training package, not megatron-core: ``GPTModel`` takes the padded size as given). The padded
  rows are split evenly (``VocabUtility.vocab_range_from_global_vocab_size``); rows past ``V`` are
  padding, and a rank may hold only padding. Tied embeddings
  (``share_embeddings_and_output_weights``) have no ``output_layer.weight`` with one pipeline stage.
* Norms (``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm``/``k_layernorm``,
  ``decoder.final_layernorm``) and the router weight are whole on every rank.
* Replicas (Note [Replicated parts] in ``refit.manifest``): every dense tensor's boxes are held by
  each of the ``dp`` data-parallel ranks of a TP rank, and every routed expert's by each of the
  ``tp * dp / (ep * etp)`` expert-data-parallel ranks of an (EP, ETP) rank
  (``parallel_state.initialize_model_parallel`` carves the expert groups out of the same
  ``tp * dp`` ranks); those parts are marked replicated where that count exceeds 1. ``dp`` is an
  option, by default the smallest the expert groups allow, ``ep * etp / gcd(tp, ep * etp)``.
  ``linear_qkv`` replicates no KV head (with ``ng < tp`` each rank holds other rows, as above).
* MoE (``MoELayer``): EP rank ``e`` holds experts ``[e * E / ep, (e + 1) * E / ep)``
  (``MoELayer.local_expert_indices``), as ``SequentialMLP``'s ``mlp.experts.local_experts.{j}``,
  each an ``MLP`` over the expert tensor-parallel group (``expert_tensor_parallel_size``; default
  ``tp``, as Megatron's): fc1 ``[gate_e; up_e]`` cut ``etp`` ways, fc2 cut along its input. One
  expert of HF's 3-D ``gate_up_proj [E, 2I, H]`` is a 2-D box with a squeezed leading dim.
  Shared experts (``SharedExpertMLP``) are an ``MLP`` over the TP group. DeepSeek-V3's
  ``e_score_correction_bias`` is the router's ``expert_bias`` buffer, which Megatron keeps in float32
  (``TopKRouter._maintain_float32_expert_bias``).
* MLA (``MLASelfAttention``, local spec): ``linear_q_down_proj`` and ``linear_kv_down_proj`` are
  ``ColumnParallelLinear`` with ``gather_output=False`` (cut ``tp`` ways, gathered in forward);
  ``linear_q_up_proj`` / ``linear_q_proj`` / ``linear_kv_up_proj`` are column-split by heads; the
  norms are ``q_layernorm`` / ``kv_layernorm``. Weights map one to one: Megatron's MLA rope
  de-interleaves the rope dims itself (``_apply_rotary_pos_emb_bshd`` with
  ``multi_latent_attention``), as transformers' DeepSeek-V3 does with ``rope_interleave=True``.

* ``spec="te"`` (``get_gpt_layer_with_transformer_engine_spec``), dense GQA families only: the same
  tensors, but a layer's ``input_layernorm`` / ``pre_mlp_layernorm`` weights are held by the
  ``TELayerNormColumnParallelLinear`` after them, as ``self_attention.linear_qkv.layer_norm_weight``
  / ``mlp.linear_fc1.layer_norm_weight`` (the names megatron-core's
  ``mcore_gpt_load_te_state_dict_pre_hook`` maps back to the local ones).

Not expressed (refused or absent): pipeline parallelism (names and layer numbers are those of one
stage), the Transformer Engine spec for MoE and MLA layers (``TEGroupedMLP``'s ``weight{j}``,
MLA's duplicated ``TELinear`` down projections: Transformer Engine is needed to build and check
them), the legacy ``GroupedMLP`` (its ``weight1`` is ``[H, E * 2I]``, a transpose of HF's, which
no box copy expresses), multi-token prediction layers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from warmlink.errors import LayoutError
from warmlink.refit.families._model import Logical, LogicalModel
from warmlink.refit.manifest import Part, Shard, TensorLayout

__all__ = ["layouts", "FAMILIES", "SPECS", "padded_vocab_size"]

#: ``model_type``s whose weights Megatron-core's local spec holds byte for byte as laid out here.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
_MLA = ("deepseek_v3",)
_OPTIONS = ("make_vocab_size_divisible_by", "etp", "etp_rank", "spec", "dp")
SPECS = ("local", "te")
_FUNC = "families.megatron.layouts"

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TE_NORM = re.compile(r"^(decoder\.layers\.\d+\.)(input_layernorm|pre_mlp_layernorm)\.weight$")
# HF name inside a layer -> Megatron name inside ``decoder.layers.{i}``, for whole (replicated) tensors.
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
    "mlp.down_proj.bias": "mlp.linear_fc2.bias",
    "mlp.gate.weight": "mlp.router.weight",
}
# HF name inside a layer -> (Megatron name, split dim) for column- (0) and row-parallel (1) weights.
_SPLIT = {
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", 1),
    "self_attn.q_a_proj.weight": ("self_attention.linear_q_down_proj.weight", 0),
    "self_attn.q_b_proj.weight": ("self_attention.linear_q_up_proj.weight", 0),
    "self_attn.kv_a_proj_with_mqa.weight": ("self_attention.linear_kv_down_proj.weight", 0),
    "self_attn.kv_b_proj.weight": ("self_attention.linear_kv_up_proj.weight", 0),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", 1),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared_experts.linear_fc2.weight", 1),
}


def padded_vocab_size(vocab: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: ``vocab`` rounded up to a multiple of
    ``make_vocab_size_divisible_by * tp`` (``_vocab_size_with_padding``, Note [Megatron layouts])."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab // multiple) * multiple


def layouts(model: LogicalModel, *, tp: int, rank: int, ep: int, ep_rank: int, **options: Any) -> dict[str, TensorLayout]:
    """The tensors Megatron-core rank (``rank`` of ``tp``, ``ep_rank`` of ``ep``) holds; Note [Megatron layouts].

    Args:
        model: the logical model (``families.logical_model``).
        tp, rank: tensor-parallel size and this rank's index in it (attention, dense MLPs, shared
            experts, vocabulary).
        ep, ep_rank: expert-parallel size and this rank's index in it (routed experts).
        options: ``make_vocab_size_divisible_by`` (int >= 1, default 128, as Megatron-LM's
            ``--make-vocab-size-divisible-by``); ``etp`` (expert tensor-parallel size, default
            ``tp``, as ``ModelParallelConfig.__post_init__`` sets it) and ``etp_rank`` (this rank's
            index in it, default ``rank`` when ``etp == tp``; else read it from
            ``parallel_state.get_expert_tensor_parallel_rank()``); ``spec``: ``"local"`` (default,
            ``get_gpt_layer_local_spec``) or ``"te"`` (``get_gpt_layer_with_transformer_engine_spec``,
            dense GQA families only: the norms become ``linear_qkv.layer_norm_weight`` and
            ``linear_fc1.layer_norm_weight``); ``dp``: data-parallel size (default the smallest
            that Megatron's expert groups allow, ``tp * dp`` a multiple of ``ep * etp``), which
            says which parts are replicas (Note [Megatron layouts]).

    Returns:
        Megatron parameter name -> layout, in the logical model's order; a new dict the caller owns.

    Raises:
        LayoutError: an unknown family or option, a size Megatron cannot split that way (naming the
            size and ``tp``/``ep``/``etp``), or a tensor no rule here knows.

    **Collective?** No. **Blocking?** No. **Warm path?** No: call once at setup.
    """
    dims = model.dims
    if dims.model_type not in FAMILIES:
        raise LayoutError(f"{_FUNC}: model_type={dims.model_type!r} is not laid out for Megatron; expected one of "
                          f"{list(FAMILIES)} (declare other layouts by hand with TensorLayout)")
    divisible, etp, etp_rank, spec, dp = _options(options, tp, rank, ep)
    if spec == "te" and (dims.model_type in _MLA or dims.num_experts):
        raise LayoutError(f"{_FUNC}: spec='te' with model_type={dims.model_type!r} is not laid out; expected a dense "
                          "GQA family (TEGroupedMLP experts and MLA's duplicated TELinear down projections cannot be "
                          "built here without Transformer Engine, so they are not described)")
    at = _Rank(model, {t.name: t for t in model.tensors}, tp, rank, ep, ep_rank, etp, etp_rank, divisible)
    # Megatron fuses q, k and v: gather each layer's, then place linear_qkv where its q comes.
    qkv: dict[int, dict[str, Logical]] = {}
    for t in model.tensors:
        m = _LAYER.match(t.name)
        if m and t.role in ("q", "k", "v") and dims.model_type not in _MLA:
            qkv.setdefault(int(m.group(1)), {})[f"{t.role}_{t.name.rsplit('.', 1)[1]}"] = t
    out: dict[str, TensorLayout] = {}
    for t in model.tensors:
        m = _LAYER.match(t.name)
        layer, rest = (int(m.group(1)), m.group(2)) if m else (None, t.name)
        if layer in qkv and t.role in ("q", "k", "v"):
            kind = t.name.rsplit(".", 1)[1]
            if _qkv_name(layer, kind) not in out:
                out[_qkv_name(layer, kind)] = _qkv(model, layer, kind, qkv[layer], tp, rank)
            continue
        for layout in _tensor(at, t, f"decoder.layers.{layer}." if m else "", rest):
            out[layout.name] = layout
    out = _te_names(out) if spec == "te" else out
    # Replicas (Note [Megatron layouts]): the dp ranks of one TP rank hold its dense boxes, the
    # tp * dp / (ep * etp) expert-data-parallel ranks of one (ep, etp) rank its experts' boxes.
    dense, experts = dp > 1, tp * dp // (ep * etp) > 1
    for name, layout in out.items():
        if (experts if ".mlp.experts.local_experts." in name else dense):
            out[name] = layout.with_replicated()
    return out


def _te_names(out: dict[str, TensorLayout]) -> dict[str, TensorLayout]:
    """The Transformer Engine spec's names (``get_gpt_layer_with_transformer_engine_spec``): a dense
    layer's norms are fused into the linear after them (``TELayerNormColumnParallelLinear``), as
    megatron-core's ``mcore_gpt_load_te_state_dict_pre_hook`` renames them; the rest is unchanged."""
    renamed = {}
    for name, layout in out.items():
        m = _TE_NORM.match(name)
        if m:
            fused = "self_attention.linear_qkv" if m.group(2) == "input_layernorm" else "mlp.linear_fc1"
            name = f"{m.group(1)}{fused}.layer_norm_weight"
            layout = TensorLayout(name, layout.dtype, layout.parts, layout.shape)
        renamed[name] = layout
    return renamed


@dataclass(frozen=True)
class _Rank:
    """One rank's place in Megatron's parallel groups, and the model it lays out."""

    model: LogicalModel
    by_name: dict[str, Logical]
    tp: int
    rank: int
    ep: int
    ep_rank: int
    etp: int
    etp_rank: int
    divisible: int


def _options(options: dict, tp: int, rank: int, ep: int) -> tuple[int, int, int, str, int]:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise LayoutError(f"{_FUNC}: option={unknown[0]!r} is unknown; expected one of {list(_OPTIONS)}")
    divisible = options.get("make_vocab_size_divisible_by", 128)
    etp = options.get("etp", tp)
    for k, v in (("make_vocab_size_divisible_by", divisible), ("etp", etp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LayoutError(f"{_FUNC}: {k}={v!r} invalid; expected an int >= 1")
    spec = options.get("spec", "local")
    if spec not in SPECS:
        raise LayoutError(f"{_FUNC}: spec={spec!r} is unknown; expected one of {list(SPECS)}")
    etp_rank = options.get("etp_rank")
    if etp_rank is None:
        if etp != tp:
            raise LayoutError(f"{_FUNC}: etp_rank=None with etp={etp} != tp={tp}; expected etp_rank given "
                              "(parallel_state.get_expert_tensor_parallel_rank())")
        etp_rank = rank
    if isinstance(etp_rank, bool) or not isinstance(etp_rank, int) or not 0 <= etp_rank < etp:
        raise LayoutError(f"{_FUNC}: etp_rank={etp_rank!r} out of range; expected 0 <= etp_rank < etp={etp}")
    dp = options.get("dp")
    if dp is None:  # the smallest dp whose tp * dp ranks the expert groups tile
        dp = ep * etp // math.gcd(tp, ep * etp)
    elif isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise LayoutError(f"{_FUNC}: dp={dp!r} invalid; expected an int >= 1")
    elif tp * dp % (ep * etp):
        raise LayoutError(f"{_FUNC}: dp={dp} with tp={tp}: tp * dp = {tp * dp} is not a multiple of ep * etp = "
                          f"{ep * etp}; expected expert groups that tile the ranks (parallel_state.initialize_model_parallel)")
    return divisible, etp, etp_rank, spec, dp


def _divide(field: str, size: int, num: int, by: str, tensor: str | None = None) -> int:
    """``size / num``, refusing a remainder as ``megatron.core.utils.divide`` does."""
    if size % num:
        where = f"tensor {tensor!r}: " if tensor else ""
        raise LayoutError(f"{_FUNC}: {where}{field}={size} not divisible by {by}={num}; expected {field} % {by} == 0 "
                          "(Megatron's divide() refuses it)")
    return size // num


def _split(t: Logical, name: str, dim: int, num: int, idx: int) -> TensorLayout:
    """Shard ``idx`` of ``num`` along ``dim`` (``ColumnParallelLinear`` / ``RowParallelLinear``)."""
    _divide(f"shape[{dim}]", t.shape[dim], num, "tp", t.name)
    return TensorLayout.plain(name, t.dtype, t.shape, dim, num, idx, t.name)


def _tensor(at: _Rank, t: Logical, prefix: str, rest: str) -> list[TensorLayout]:
    """The Megatron tensors logical tensor ``t`` lands in (several for routed experts, none for an
    ``up_proj``, which its ``gate_proj`` places)."""
    if t.role in ("embed", "lm_head"):
        name = "embedding.word_embeddings.weight" if t.role == "embed" else "output_layer.weight"
        return [_vocab(t, name, at.divisible, at.tp, at.rank)]
    if t.name == "model.norm.weight":
        return [TensorLayout.plain("decoder.final_layernorm.weight", t.dtype, t.shape, logical=t.name)]
    if rest in _REPLICATED:
        return [TensorLayout.plain(prefix + _REPLICATED[rest], t.dtype, t.shape, logical=t.name)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [TensorLayout.plain(prefix + "mlp.router.expert_bias", "float32", t.shape, logical=t.name)]
    if rest in _SPLIT:
        name, dim = _SPLIT[rest]
        return [_split(t, prefix + name, dim, at.tp, at.rank)]
    if t.role == "q":  # MLA without q_lora_rank (GQA's q goes to _qkv)
        return [_split(t, prefix + "self_attention.linear_q_proj.weight", 0, at.tp, at.rank)]
    if t.role in ("gate", "up"):
        if t.role == "up":
            _partner(at, t.name.replace("up_proj.", "gate_proj."))
            return []
        up = _partner(at, t.name.replace("gate_proj.", "up_proj."))
        return [_fc1(prefix + rest.replace("gate_proj.", "linear_fc1."), t, up, at.tp, at.rank)]
    if t.role in ("experts_gate_up", "experts_down") and not at.model.dims.interleaved_experts:
        return _experts(t, prefix, at.ep, at.ep_rank, at.etp, at.etp_rank)
    raise LayoutError(f"{_FUNC}: tensor {t.name!r} (role {t.role!r}, shape {t.shape}) has no Megatron rule; expected "
                      f"a tensor of {list(FAMILIES)} models (declare it by hand with TensorLayout)")


def _partner(at: _Rank, name: str) -> Logical:
    t = at.by_name.get(name)
    if t is None:
        raise LayoutError(f"{_FUNC}: tensor {name!r} is absent from the model; expected gate and up projections in "
                          "pairs (Megatron's linear_fc1 holds both)")
    return t


def _vocab(t: Logical, name: str, divisible: int, tp: int, rank: int) -> TensorLayout:
    """Rank ``rank``'s rows of the padded vocabulary; rows past the real vocabulary are padding."""
    vocab, rest = t.shape[0], t.shape[1:]
    per_rank = padded_vocab_size(vocab, divisible, tp) // tp
    start = min(rank * per_rank, vocab)
    stop = min((rank + 1) * per_rank, vocab)
    shard = Shard(t.shape, ((start, stop),) + tuple((0, d) for d in rest))
    return TensorLayout(name, t.dtype, (Part(t.name, shard, (0,) * len(t.shape)),), (per_rank,) + rest)


def _fc1(name: str, gate: Logical, up: Logical, num: int, idx: int) -> TensorLayout:
    """``[gate_idx; up_idx]`` along dim 0 (``linear_fc1`` with ``stride=2``); weight or bias."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise LayoutError(f"{_FUNC}: {gate.name!r} {gate.shape} {gate.dtype} and {up.name!r} {up.shape} {up.dtype} "
                          "differ; expected equal gate and up projections")
    _divide("intermediate", gate.shape[0], num, "tp", gate.name)
    shard = Shard.split(gate.shape, 0, num, idx)
    return TensorLayout.fused(name, gate.dtype, [(gate.name, shard), (up.name, shard)])


def _experts(t: Logical, prefix: str, ep: int, ep_rank: int, etp: int, etp_rank: int) -> list[TensorLayout]:
    """``SequentialMLP``'s local experts of this EP rank: fc1 ``[gate_e; up_e]`` or fc2, cut ``etp`` ways.

    ``t`` is HF's ``gate_up_proj [E, 2I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``) or
    ``down_proj [E, H, I]``.
    """
    num_experts = t.shape[0]
    num_local = _divide("experts", num_experts, ep, "ep", t.name)
    fc1 = t.role == "experts_gate_up"
    inter = t.shape[1] // 2 if fc1 else t.shape[2]
    if fc1 and t.shape[1] % 2:
        raise LayoutError(f"{_FUNC}: {t.name!r} shape {t.shape} has an odd dim 1; expected [E, 2 * I, H]")
    per = _divide("intermediate", inter, etp, "etp", t.name)
    lo = etp_rank * per
    out = []
    for j in range(num_local):
        e = ep_rank * num_local + j
        name = f"{prefix}mlp.experts.local_experts.{j}.{'linear_fc1' if fc1 else 'linear_fc2'}.weight"
        if fc1:
            hidden = t.shape[2]
            parts = (Part(t.name, Shard(t.shape, ((e, e + 1), (lo, lo + per), (0, hidden))), (0, 0)),
                     Part(t.name, Shard(t.shape, ((e, e + 1), (inter + lo, inter + lo + per), (0, hidden))), (per, 0)))
            out.append(TensorLayout(name, t.dtype, parts, (2 * per, hidden)))
        else:
            hidden = t.shape[1]
            shard = Shard(t.shape, ((e, e + 1), (0, hidden), (lo, lo + per)))
            out.append(TensorLayout(name, t.dtype, (Part(t.name, shard, (0, 0)),), (hidden, per)))
    return out


def _qkv_name(layer: int, kind: str) -> str:
    return f"decoder.layers.{layer}.self_attention.linear_qkv.{kind}"


def _qkv(model: LogicalModel, layer: int, kind: str, found: dict[str, Logical], tp: int, rank: int) -> TensorLayout:
    """``linear_qkv`` (``kind`` ``"weight"`` or ``"bias"``) of ``layer``: the rows of the interleaved
    ``[q_g; k_g; v_g]`` per query group that this rank holds (Note [Megatron layouts])."""
    name = _qkv_name(layer, kind)
    missing = [r for r in "qkv" if f"{r}_{kind}" not in found]
    if missing:
        raise LayoutError(f"{_FUNC}: {name!r} needs q, k and v {kind}s of layer {layer}; {missing} absent; expected "
                          "all three (Megatron fuses them)")
    q, k, v = (found[f"{r}_{kind}"] for r in "qkv")
    d = model.dims
    heads, groups, head_dim = d.num_heads, d.num_kv_heads, d.head_dim
    for t, rows in ((q, heads * head_dim), (k, groups * head_dim), (v, groups * head_dim)):
        if t.shape[0] != rows:
            raise LayoutError(f"{_FUNC}: {t.name!r} shape {t.shape}; expected {rows} rows for {heads} heads, "
                              f"{groups} query groups of head_dim {head_dim}")
    _divide("num_attention_heads", heads, tp, "tp", name)
    if groups >= tp:
        _divide("num_query_groups", groups, tp, "tp", name)
    elif tp % groups:
        raise LayoutError(f"{_FUNC}: tensor {name!r}: tp={tp} not a multiple of num_query_groups={groups}; expected "
                          "tp % groups == 0 when tp > groups (Megatron gives each group tp / groups ranks)")
    per_group = heads // groups
    rows_per_rank = _divide("rows", (heads + 2 * groups) * head_dim, tp, "tp", name)
    lo, hi = rank * rows_per_rank, (rank + 1) * rows_per_rank
    # The full tensor's rows in order: per group g, its query heads, its key head, its value head.
    segments = []
    for g in range(groups):
        segments += [(q, g * per_group * head_dim, per_group * head_dim), (k, g * head_dim, head_dim),
                     (v, g * head_dim, head_dim)]
    parts, at = [], 0
    for t, start, length in segments:
        a, b = max(at, lo), min(at + length, hi)
        if a < b:
            bounds = ((start + a - at, start + b - at),) + tuple((0, n) for n in t.shape[1:])
            parts.append((t.name, Shard(t.shape, bounds)))
        at += length
    return TensorLayout.fused(name, q.dtype, parts)
