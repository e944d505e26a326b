"""The ``"vllm"`` convention: the tensors vLLM's model modules hold, under their parameter names.

Mirrors vLLM 0.32 (``vllm/model_executor``): the layers in ``layers/linear.py``,
``layers/vocab_parallel_embedding.py`` and ``layers/fused_moe/``, and which layer each model file
(``models/{llama,mistral,qwen2,qwen3,qwen3_moe,mixtral,deepseek_v2,gemma2,gemma3,phi3,gpt_oss}.py``) builds
for each transformers tensor. The rules are in Note [vLLM layouts]; physical names are vLLM's
``named_parameters()`` (a tied ``lm_head`` is one tensor with ``embed_tokens``, listed once).

# Note [vLLM layouts]
With ``tp`` ranks, this rank ``rank``, and ``divide(a, b)`` vLLM's assert that ``b`` divides ``a``:

* ``embed_tokens`` / ``lm_head`` (``VocabParallelEmbedding`` / ``ParallelLMHead``): the vocabulary
  is padded to a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``), each rank holds
  ``divide(padded, tp)`` rows from ``rank * per_rank`` (``vocab_range_from_global_vocab_size``), the
  rows past the real vocabulary are padding (``weight_loader`` zero-fills them).
* ``qkv_proj`` (``QKVParallelLinear``): per rank ``[q; k; v]`` along dim 0 (weight and bias).
  q holds ``divide(num_heads, tp)`` heads from ``rank``; with ``tp >= num_kv_heads`` each KV head is
  replicated ``divide(tp, num_kv_heads)`` times and the rank holds head ``rank // replicas``, else
  ``divide(num_kv_heads, tp)`` heads from ``rank``. Phi-3's fused ``qkv_proj`` loads through the
  same loader (``loaded_shard_id=None``): the same rows, as boxes of the one HF tensor.
* ``gate_up_proj`` (``MergedColumnParallelLinear``): ``[gate; up]`` per rank, each
  ``divide(intermediate, tp)`` rows from ``rank``; Phi-3's fused ``gate_up_proj`` likewise.
* ``ColumnParallelLinear`` (MLA ``q_proj``, ``q_b_proj``, ``kv_b_proj``): ``divide(rows, tp)`` rows;
  ``RowParallelLinear`` (``o_proj``, ``down_proj``): ``divide(cols, tp)`` columns, bias replicated.
* DeepSeek MLA with ``q_lora_rank``: ``fused_qkv_a_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]``,
  replicated (``DeepSeekV2FusedQkvAProjLinear``, ``disable_tp=True``); without it
  ``kv_a_proj_with_mqa`` is replicated (``ReplicatedLinear``).
* Experts (``RoutedExperts`` under the ``MoERunner``, so ``...experts.routed_experts.w13_weight``):
  ``w13_weight [E_local, 2 * I_local, H]`` = ``[w1 (gate); w3 (up)]`` along dim 1 and
  ``w2_weight [E_local, H, I_local]``. Without EP every rank holds every expert and
  ``I_local = divide(I, tp)`` (``_load_w13`` / ``_load_w2``). With EP (``ep > 1``) vLLM sets the
  MoE TP size to 1 and ``ep = tp * dp`` with ``ep_rank = dp_rank * tp + rank``
  (``FusedMoEParallelConfig.make``): whole experts, the first ``E % ep`` ranks one more
  (``determine_expert_map``, "linear" placement).
* Routers (``GateLinear``), norms and DeepSeek's ``e_score_correction_bias`` are replicated; the
  latter is a float32 Parameter of the gate in ``DeepseekV2MoE``, so its layout says float32 whatever
  ``dtype`` the caller asks for.
* Replicas (Note [Replicated parts] in ``refit.manifest``): k and v parts are marked replicated when
  ``tp > num_kv_heads``, and with ``ep > tp`` every tensor but the experts is (the ``dp = ep / tp``
  ranks of one TP rank hold the same boxes); whole tensors are replicas without the flag.

GPT-OSS differs in names, experts and biases: Note [vLLM GPT-OSS].

Not described: vLLM's "round_robin" expert placement and EPLB redundant experts, data parallelism
without EP (experts then shard ``tp * dp`` ways), sequence-parallel MoE (replicated shared experts)
and quantized checkpoints.

# Note [vLLM GPT-OSS]
``GptOssForCausalLM`` (``models/gpt_oss.py``) names its modules as its ``hf_to_vllm_mapper`` maps
transformers' (``self_attn`` -> ``attn``, ``embed_tokens`` -> ``embedding``), never ties its
``ParallelLMHead`` (a tied model's head holds the embedding, as DeepSeek's does), and loads an
unquantized checkpoint (``GptOssModel._load_weights_other``) by plain slicing. Without EP, with
``I_local = divide(I, tp)`` (``FusedMoEConfig``) and ``[a, b)`` = ``[rank, rank + 1) * I_local``:

* ``w13_weight [E, 2 I_local, H]`` = ``gate_up_proj[:, :, 2a:2b].permute(0, 2, 1)``: columns of
  transformers' interleaved ``[E, H, 2I]`` (gate and up alternate, and vLLM's ``swigluoai``
  activation reads them so: nothing is de-interleaved), transposed. One part with
  ``perm=(0, 2, 1)`` (Note [Transposed parts] in ``refit.manifest``).
* ``w2_weight [E, H, I_local]`` = ``down_proj[:, a:b, :].permute(0, 2, 1)`` of ``[E, I, H]``, likewise.
* ``w13_bias [E, 2 I_local]`` = ``gate_up_proj_bias[:, 2a:2b]``: a box.
* ``w2_bias [E, H]``: ``down_proj_bias`` on TP rank 0; zeros on the others (the loader zeroes it:
  each rank adds its bias before the all-reduce), i.e. one empty box, all padding.
* ``attn.sinks [heads / tp]`` = ``sinks[rank * heads / tp:][:heads / tp]``; ``qkv_proj`` (with
  biases) and ``o_proj`` (its bias whole on every rank) are Llama's; ``mlp.router`` (``GateLinear``,
  weight and bias) is replicated.

With EP the loader takes whole experts ``[ep_rank * n, (ep_rank + 1) * n)`` with ``n = E // ep``
for all four expert tensors (``w2_bias`` too, on every rank), transposed as above. vLLM's "linear"
placement gives the first ``E % ep`` ranks one expert more, which that loader does not fill, so
``ep`` must divide ``E`` here. Not described: MXFP4 and quark checkpoints (their own loaders) and
backends that pad ``I_local`` (FlashInfer TRT-LLM, AITER), whose experts are re-laid for the kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from warmlink.errors import LayoutError
from warmlink.refit.families._model import Logical, LogicalModel
from warmlink.refit.manifest import Part, Shard, TensorLayout, split_bounds

__all__ = ["layouts", "FAMILIES", "VOCAB_PADDING"]

_FUNC = "families.vllm"

#: vLLM's DEFAULT_VOCAB_PADDING_SIZE: every family here builds its embeddings with it.
VOCAB_PADDING = 64


@dataclass(frozen=True)
class _Family:
    """What one vLLM model file does differently from Llama's."""

    moe_block: str = "mlp"  # the MoE block's attribute (Mixtral: block_sparse_moe)
    lm_head: bool = True  # Gemma 2 computes logits with embed_tokens and has no lm_head
    ties: bool = True  # DeepseekV2ForCausalLM never ties its ParallelLMHead to embed_tokens
    o_bias: bool = True  # Qwen3Attention builds o_proj with bias=False whatever the config says
    unsupported: str | None = None
    renames: tuple[tuple[str, str], ...] = ()  # vLLM module names that differ from transformers'

#: model_type -> what its vLLM model file builds.
FAMILIES: dict[str, _Family] = {
    "llama": _Family(), "mistral": _Family(), "qwen2": _Family(), "qwen3": _Family(o_bias=False),
    "qwen3_moe": _Family(o_bias=False), "mixtral": _Family(moe_block="block_sparse_moe"),
    "deepseek_v2": _Family(ties=False), "deepseek_v3": _Family(ties=False), "gemma2": _Family(lm_head=False),
    "gemma3_text": _Family(), "phi3": _Family(),
    "gpt_oss": _Family(ties=False, renames=((".self_attn.", ".attn."), ("model.embed_tokens.", "model.embedding."))),
}

_MOE_ROLES = frozenset({"router", "router_bias", "experts_gate_up", "experts_down", "experts_gate_up_bias",
                        "experts_down_bias"})


def _divide(what: str, size: int, by: int, by_name: str, where: str) -> int:
    """vLLM's ``divide(size, by)``, refused with a LayoutError instead of an assert."""
    if size % by:
        raise LayoutError(f"{_FUNC}: {what}={size} is not divisible by {by_name}={by}; expected {by_name} to divide "
                          f"{what} ({where})")
    return size // by


def _rows(t: Logical, start: int, stop: int) -> Shard:
    return Shard(t.shape, ((start, stop),) + tuple((0, d) for d in t.shape[1:]))


class _Rank:
    """One vLLM rank: TP rank ``rank`` of ``tp``, EP rank ``ep_rank`` of ``ep``."""

    def __init__(self, model: LogicalModel, tp: int, rank: int, ep: int, ep_rank: int) -> None:
        self.dims, self.tp, self.rank, self.ep, self.ep_rank = model.dims, tp, rank, ep, ep_rank

    # -- one logical tensor ----------------------------------------------------------------------
    def whole(self, t: Logical) -> list[tuple[str, Shard]]:
        return [(t.name, Shard(t.shape))]

    def column(self, t: Logical, what: str, where: str) -> list[tuple[str, Shard]]:
        per = _divide(what, t.shape[0], self.tp, "tp", where)
        return [(t.name, _rows(t, self.rank * per, (self.rank + 1) * per))]

    def row(self, t: Logical, what: str) -> list[tuple[str, Shard]]:
        _divide(what, t.shape[1], self.tp, "tp", "RowParallelLinear: divide(input_size, tp_size)")
        return [(t.name, Shard.split(t.shape, 1, self.tp, self.rank))]

    def heads(self) -> None:
        _divide("num_attention_heads", self.dims.num_heads, self.tp, "tp", "vLLM attention: divide(num_heads, tp_size)")

    def vocab(self, t: Logical) -> tuple[list[tuple[str, Shard]], tuple[int, ...]]:
        vocab = t.shape[0]
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        per = _divide("padded vocab_size", padded, self.tp, "tp",
                      f"VocabParallelEmbedding pads vocab_size={vocab} to a multiple of {VOCAB_PADDING}")
        start = self.rank * per
        return [(t.name, _rows(t, min(start, vocab), min(start + per, vocab)))], (per,) + t.shape[1:]

    # -- fused tensors ---------------------------------------------------------------------------
    def qkv_rows(self, q_rows: int, kv_rows: int) -> list[tuple[int, int]]:
        """``[start, stop)`` rows of q, k, v this rank holds, each in its own tensor's coordinates
        (QKVParallelLinear.weight_loader: ``shard_rank = tp_rank // num_kv_head_replicas``)."""
        d = self.dims
        self.heads()
        q_per = q_rows // self.tp
        if self.tp >= d.num_kv_heads:
            replicas = _divide("tp", self.tp, d.num_kv_heads, "num_key_value_heads",
                               "QKVParallelLinear replicates each KV head divide(tp, num_kv_heads) times")
            kv_per, kv_rank = kv_rows // d.num_kv_heads, self.rank // replicas
        else:
            _divide("num_key_value_heads", d.num_kv_heads, self.tp, "tp", "QKVParallelLinear: divide(num_kv_heads, tp)")
            kv_per, kv_rank = kv_rows // self.tp, self.rank
        q = (self.rank * q_per, (self.rank + 1) * q_per)
        kv = (kv_rank * kv_per, (kv_rank + 1) * kv_per)
        return [q, kv, kv]

    @property
    def kv_replicated(self) -> bool:
        """Each KV head on ``divide(tp, num_kv_heads)`` ranks (``num_kv_head_replicas > 1``): k and v
        parts are marked replicated (Note [Replicated parts] in ``refit.manifest``)."""
        return self.tp > self.dims.num_kv_heads

    def qkv(self, q: Logical, k: Logical, v: Logical) -> list[tuple[str, Shard, bool]]:
        rows = self.qkv_rows(q.shape[0], k.shape[0])
        replicated = (False, self.kv_replicated, self.kv_replicated)
        return [(t.name, _rows(t, a, b), rep) for t, (a, b), rep in zip((q, k, v), rows, replicated)]

    def qkv_fused(self, t: Logical) -> list[tuple[str, Shard]]:
        """Phi-3: ``qkv_proj`` fused by transformers, split by QKVParallelLinear's loader."""
        d = self.dims
        head_dim, extra = divmod(t.shape[0], d.num_heads + 2 * d.num_kv_heads)
        if extra:
            raise LayoutError(f"{_FUNC}: tensor {t.name!r} has {t.shape[0]} rows; expected a multiple of num_heads + "
                              f"2 * num_key_value_heads = {d.num_heads + 2 * d.num_kv_heads} ([q; k; v] by heads)")
        q_rows, kv_rows = d.num_heads * head_dim, d.num_kv_heads * head_dim
        bases = (0, q_rows, q_rows + kv_rows)
        replicated = (False, self.kv_replicated, self.kv_replicated)
        return [(t.name, _rows(t, base + a, base + b), rep)
                for base, (a, b), rep in zip(bases, self.qkv_rows(q_rows, kv_rows), replicated)]

    def gate_up(self, gate: Logical, up: Logical) -> list[tuple[str, Shard]]:
        where = "MergedColumnParallelLinear: divide(output_size, tp_size)"
        return self.column(gate, "intermediate_size", where) + self.column(up, "intermediate_size", where)

    def gate_up_fused(self, t: Logical) -> list[tuple[str, Shard]]:
        """Phi-3: ``gate_up_proj`` = ``[gate; up]`` fused by transformers, split per output."""
        half = t.shape[0] // 2
        per = _divide("intermediate_size", half, self.tp, "tp", "MergedColumnParallelLinear: divide(output_size, tp)")
        return [(t.name, _rows(t, base + self.rank * per, base + (self.rank + 1) * per)) for base in (0, half)]

    # -- experts ---------------------------------------------------------------------------------
    def experts(self, t: Logical) -> tuple[list[Part], tuple[int, ...]]:
        """``w13_weight`` from ``gate_up_proj [E, 2I, H]`` or ``w2_weight`` from ``down_proj [E, H, I]``."""
        num = t.shape[0]
        if self.ep > 1:
            first, last = split_bounds(num, self.ep, self.ep_rank)
            moe_tp, moe_rank = 1, 0
        else:
            first, last, moe_tp, moe_rank = 0, num, self.tp, self.rank
        if t.role == "experts_down":
            _, hidden, inter = t.shape
            per = _divide("moe_intermediate_size", inter, moe_tp, "tp", "FusedMoEConfig: intermediate_size % tp_size")
            box = ((first, last), (0, hidden), (moe_rank * per, (moe_rank + 1) * per))
            return [Part(t.name, Shard(t.shape, box), (0, 0, 0))], (last - first, hidden, per)
        _, two_inter, hidden = t.shape
        inter = two_inter // 2
        per = _divide("moe_intermediate_size", inter, moe_tp, "tp", "FusedMoEConfig: intermediate_size % tp_size")
        if moe_tp == 1:  # whole experts: [gate; up] is the HF tensor's own row order
            box = ((first, last), (0, two_inter), (0, hidden))
            return [Part(t.name, Shard(t.shape, box), (0, 0, 0))], (last - first, two_inter, hidden)
        lo, hi = moe_rank * per, (moe_rank + 1) * per
        parts = [Part(t.name, Shard(t.shape, ((first, last), (base + lo, base + hi), (0, hidden))), (0, at, 0))
                 for base, at in ((0, 0), (inter, per))]  # w1 (gate) rows, then w3 (up) rows
        return parts, (last - first, 2 * per, hidden)

    # -- GPT-OSS experts (Note [vLLM GPT-OSS]) --------------------------------------------------
    def oss_experts(self, t: Logical) -> tuple[list[Part], tuple[int, ...]]:
        """Weights and biases of the four ``routed_experts`` tensors, from transformers'
        ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` and their biases ``[E, 2I]``, ``[E, H]``."""
        num, role = t.shape[0], t.role
        if self.ep > 1:
            n = _divide("num_local_experts", num, self.ep, "ep",
                        "GptOssModel.load_weights takes num_experts // ep_size experts per rank")
            first, last = self.ep_rank * n, (self.ep_rank + 1) * n
        else:
            first, last = 0, num
        if role == "experts_down_bias":
            if self.ep == 1 and self.rank > 0:  # zeroed by the loader: one empty box, all padding
                return [Part(t.name, Shard(t.shape, ((0, 0), (0, t.shape[1]))), (0, 0))], t.shape
            return [Part(t.name, _rows(t, first, last), (0, 0))], (last - first, t.shape[1])
        inter = t.shape[1] if role == "experts_down" else t.shape[-1] // 2
        per, lo = inter, 0
        if self.ep == 1:
            per = _divide("intermediate_size", inter, self.tp, "tp", "FusedMoEConfig: intermediate_size % tp_size")
            lo = self.rank * per
        experts = (first, last)
        if role == "experts_gate_up_bias":
            return [Part(t.name, Shard(t.shape, (experts, (2 * lo, 2 * (lo + per)))), (0, 0))], (last - first, 2 * per)
        if role == "experts_gate_up":  # [E, H, 2I] columns 2a:2b, held as [E, 2 I_local, H]
            hidden = t.shape[1]
            box, shape = (experts, (0, hidden), (2 * lo, 2 * (lo + per))), (last - first, 2 * per, hidden)
        else:  # experts_down: [E, I, H] rows a:b, held as [E, H, I_local]
            hidden = t.shape[2]
            box, shape = (experts, (lo, lo + per), (0, hidden)), (last - first, hidden, per)
        return [Part(t.name, Shard(t.shape, box), (0, 0, 0), (0, 2, 1))], shape


def _physical(t: Logical, fam: _Family, fused_a: bool, mla: bool) -> str:
    """vLLM's parameter name for the tensor holding ``t`` (Note [vLLM layouts])."""
    name, role = t.name, t.role
    for old, new in fam.renames:
        name = name.replace(old, new, 1)
    if role in _MOE_ROLES and fam.moe_block != "mlp":
        name = name.replace(".mlp.", f".{fam.moe_block}.", 1)
    if role in ("q", "k", "v") and not mla:
        return re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name)
    if role in ("gate", "up"):
        return re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name)
    if role in ("mla_q_a", "mla_kv_a") and fused_a:
        return re.sub(r"\.(q_a_proj|kv_a_proj_with_mqa)\.", ".fused_qkv_a_proj.", name)
    if role == "experts_gate_up":
        return name[: -len("gate_up_proj")] + "routed_experts.w13_weight"
    if role == "experts_down":
        return name[: -len("down_proj")] + "routed_experts.w2_weight"
    if role == "experts_gate_up_bias":  # GPT-OSS
        return name[: -len("gate_up_proj_bias")] + "routed_experts.w13_bias"
    if role == "experts_down_bias":
        return name[: -len("down_proj_bias")] + "routed_experts.w2_bias"
    return name


def _single(r: _Rank, t: Logical, fam: _Family) -> tuple[list, tuple[int, ...] | None]:
    """Boxes (and the padded physical shape, if any) of the tensor that holds ``t`` alone."""
    role = t.role
    if role in ("embed", "lm_head"):
        return r.vocab(t)
    if role in ("norm", "router", "router_bias", "o_bias", "down_bias", "mla_kv_a"):
        if role == "o_bias" and not fam.o_bias:
            raise LayoutError(f"{_FUNC}: tensor {t.name!r}: vLLM's {r.dims.model_type} attention builds o_proj without "
                              "a bias; expected attention_bias=False (or declare this tensor by hand)")
        return r.whole(t), None
    if role in ("o", "down"):
        if role == "o":
            r.heads()
        return r.row(t, "num_heads * head_dim" if role == "o" else "intermediate_size"), None
    if role in ("q", "mla_q_b", "mla_kv_b"):
        r.heads()
        return r.column(t, "rows", "ColumnParallelLinear: divide(output_size, tp_size)"), None
    if role == "sinks":  # GPT-OSS: one per query head, split as the heads (OAIAttention)
        r.heads()
        return r.column(t, "num_attention_heads", "OAIAttention: sinks of num_attention_heads // tp heads"), None
    if role in ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias") \
            and r.dims.interleaved_experts:
        return r.oss_experts(t)
    if role == "qkv":
        return r.qkv_fused(t), None
    if role == "gate_up":
        return r.gate_up_fused(t), None
    if role in ("experts_gate_up", "experts_down"):
        return r.experts(t)
    raise LayoutError(f"{_FUNC}: tensor {t.name!r} has role={role!r}, which vLLM's {r.dims.model_type} model holds in "
                      "no module described here; expected a role of Note [vLLM layouts] (declare it by hand with "
                      "TensorLayout)")


def layouts(
    model: LogicalModel, *, tp: int, rank: int, ep: int, ep_rank: int, **options: Any
) -> dict[str, TensorLayout]:
    """Every tensor vLLM rank (``rank`` of ``tp``; ``ep_rank`` of ``ep`` for experts) holds, under
    vLLM's parameter names (Note [vLLM layouts]). No options.

    Raises:
        LayoutError: an option, a family vLLM is not described for, a size vLLM's ``divide``
            refuses, an EP size that is not ``tp * dp`` with ``ep_rank % tp == rank`` (for GPT-OSS
            also one that does not divide the experts, Note [vLLM GPT-OSS]), or a tensor vLLM's
            module does not hold.
    """
    if options:
        raise LayoutError(f"{_FUNC}: options {sorted(options)} unknown; expected none (the vllm convention has none)")
    dims = model.dims
    fam = FAMILIES.get(dims.model_type)
    if fam is None:
        raise LayoutError(f"{_FUNC}: model_type={dims.model_type!r} has no vLLM description; expected one of "
                          f"{sorted(k for k, f in FAMILIES.items() if f.unsupported is None)}")
    if fam.unsupported is not None:
        raise LayoutError(f"{_FUNC}: model_type={dims.model_type!r} is not supported: {fam.unsupported}; expected "
                          "another family (declare these tensors by hand, or refit them through load_weights)")
    if ep > 1 and (ep % tp or ep_rank % tp != rank):
        raise LayoutError(f"{_FUNC}: ep={ep}, ep_rank={ep_rank} with tp={tp}, rank={rank}; expected ep = tp * dp and "
                          "ep_rank = dp_rank * tp + rank, as vLLM's FusedMoEParallelConfig.make flattens them")
    r = _Rank(model, tp, rank, ep, ep_rank)
    mla = bool(model.by_role("mla_kv_a"))
    fused_a = bool(model.by_role("mla_q_a"))
    groups: dict[str, dict[str, Logical]] = {}
    for t in model.tensors:
        members = groups.setdefault(_physical(t, fam, fused_a, mla), {})
        if t.role in members:
            raise LayoutError(f"{_FUNC}: tensors {members[t.role].name!r} and {t.name!r} map to one vLLM tensor; "
                              "expected one tensor per role and module")
        members[t.role] = t
    by_name = {t.name: t for t in model.tensors}
    if dims.tied and not fam.ties and "lm_head.weight" not in groups and "model.embed_tokens.weight" in by_name:
        groups["lm_head.weight"] = {"lm_head": by_name["model.embed_tokens.weight"]}
    out: dict[str, TensorLayout] = {}
    for phys, members in groups.items():
        try:
            layout = _layout(r, fam, phys, members)
        except LayoutError as e:  # a size rule names the size; the error names the tensor too
            names = (phys, *(t.name for t in members.values()))
            if any(repr(n) in str(e) for n in names):
                raise
            raise LayoutError(f"{_FUNC}: tensor {phys!r}: {str(e).removeprefix(_FUNC + ': ')}") from None
        # ep = tp * dp: each of the dp ranks of one TP rank holds its dense tensors (Note [Replicated
        # parts] in refit.manifest); experts are split over all ep ranks
        if ep > tp and not any(role.startswith("experts_") for role in members):
            layout = layout.with_replicated()
        out[phys] = layout
    return out


def _layout(r: _Rank, fam: _Family, phys: str, members: dict[str, Logical]) -> TensorLayout:
    roles = set(members)
    first = next(iter(members.values()))
    dtype = first.dtype
    for module, want in ((".qkv_proj.", ("q", "k", "v")), (".gate_up_proj.", ("gate", "up")),
                         (".fused_qkv_a_proj.", ("mla_q_a", "mla_kv_a"))):
        if module not in phys or roles in ({"qkv"}, {"gate_up"}):
            continue  # Phi-3's qkv_proj / gate_up_proj are fused by transformers already: one tensor
        if roles != set(want):
            raise LayoutError(f"{_FUNC}: {phys!r} needs {list(want)}; the model has only {sorted(roles)}")
        if want[0] == "q":
            return TensorLayout.fused(phys, dtype, r.qkv(*(members[w] for w in want)))
        if want[0] == "gate":
            return TensorLayout.fused(phys, dtype, r.gate_up(*(members[w] for w in want)))
        return TensorLayout.fused(phys, dtype, r.whole(members["mla_q_a"]) + r.whole(members["mla_kv_a"]))
    if len(members) != 1:
        held = sorted(t.name for t in members.values())
        raise LayoutError(f"{_FUNC}: {phys!r} would hold {held}; expected one tensor")
    t = first
    if t.role == "lm_head" and not fam.lm_head:
        raise LayoutError(f"{_FUNC}: tensor {t.name!r}: vLLM's {r.dims.model_type} model has no lm_head (it computes "
                          "logits with embed_tokens); expected tie_word_embeddings=True")
    if t.name.endswith("e_score_correction_bias"):
        dtype = "float32"  # DeepseekV2MoE: nn.Parameter(torch.empty(n_routed_experts, dtype=torch.float32))
    boxes, shape = _single(r, t, fam)
    if boxes and isinstance(boxes[0], Part):
        return TensorLayout(phys, dtype, tuple(boxes), shape)
    if len(boxes) == 1:
        return TensorLayout(phys, dtype, (Part(boxes[0][0], boxes[0][1]),), shape)
    return TensorLayout.fused(phys, dtype, boxes, shape=shape)
