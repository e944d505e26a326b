"""The ``"hf"`` convention: tensors as transformers itself holds them, sharded by its own TP/EP plans.

Physical names and shapes are transformers' (``model.layers.0.self_attn.q_proj.weight``, experts
``mlp.experts.gate_up_proj`` ``[E, 2I, H]``), nothing fused or padded. At ``tp > 1`` each parameter
is sharded as ``from_pretrained(distributed_config=DistributedConfig(tp_size=tp, ep_size=ep))``
shards it, and the plan that says how is the model's own (``model.tp_plan`` / ``model.ep_plan``,
read in ``families._model``); only the mapping from a style name to its DTensor placement is
restated here, in Note [HF parallel styles], and the placements themselves are PyTorch's.

# Note [HF parallel styles]
transformers 5 turns every planned parameter into a DTensor (``distributed/tensor_parallel.py``,
``expert_parallel.py``), so a rank holds that DTensor's local shard, with ``torch.chunk`` semantics
(uneven and empty trailing shards included: transformers refuses none of them). A parameter's style
is its own plan entry, else its module's (``parallel_utils._get_parameter_plan``, layer numbers
read as ``*``); with ``ep > 1``, rules of the ``ep_plan`` win and drop ``tp_plan`` rules on the
same modules and their children (``DistributedMixin._resolve_parallel_plans``). ``shard_param``
of each style places a parameter of ``ndim`` dims:

* ``colwise``, ``colwise_gather_output``, ``colwise_rep`` (``ColwiseParallel``): ``Shard(ndim - 2)``
  (weight rows; a 1-D bias: its only dim; 3-D experts: dim 1).
* ``rowwise``, ``rowwise_split_input``, ``rowwise_rep`` (``RowwiseParallel``): a parameter named
  ``bias`` is replicated, any other ``Shard(-1)``.
* ``embedding_rowwise`` / ``embedding_colwise`` (``EmbeddingParallel``): ``Shard(0)`` / ``Shard(1)``;
  ``init_parallel_plans`` adds ``embed_tokens: embedding_rowwise`` to every non-empty plan.
* ``packed_colwise`` (``PackedColwiseParallel``): 1-D ``Shard(-1)``, else
  ``_StridedShard(ndim - 2, split_factor=2)``: rank ``r`` holds ``[gate.chunk(tp)[r]; up.chunk(tp)[r]]``.
* ``packed_rowwise`` (``PackedRowwiseParallel``): 1-D replicated, else ``_StridedShard(-1, 2)``.
* ``grouped_gemm`` (``MoEParamShard``, on the EP mesh): ``Shard(0)``, whole experts; the experts
  must divide evenly (``MoEParamShard.shard_param`` raises otherwise).
* every other style (``replicated_with_grad_allreduce``, ``moe_tp_experts``, ``ep_dispatch_experts``,
  ``mla_kv_a_proj``, ...) has no ``shard_param``: replicated. Buffers are never planned: replicated.

With ``ep > tp`` the ``ep / tp`` ranks that share a TP rank hold the same boxes of every tensor the
EP plan does not place, so those parts are marked replicated (Note [Replicated parts] in
``refit.manifest``).

Sharding of the dense part by FSDP (``fsdp_size > 1``, which transformers needs when ``ep > tp``) is
not a TP/EP plan and is not described here: such ranks publish through their DTensor placements
(``Publisher.add_module`` reads them).
"""

from __future__ import annotations

import re
from typing import Any

from warmlink.errors import LayoutError
from warmlink.refit.dtensor import index_runs
from warmlink.refit.families._model import Logical, LogicalModel
from warmlink.refit.manifest import Part, Shard, TensorLayout

__all__ = ["layouts", "parameter_style", "style_placement"]

_FUNC = "families.hf"

# Styles whose shard_param is the no-op of TensorParallelLayer / ExpertParallelLayer.
_UNSHARDED = frozenset({
    "replicated_with_grad_allreduce", "replicate", "all_reduce", "mla_kv_a_proj", "sequence_parallel",
    "moe_tp_experts", "moe_identity_expert", "local_params", "ep_dispatch_experts",
})
_COLWISE = frozenset({"colwise", "colwise_gather_output", "colwise_rep"})
_ROWWISE = frozenset({"rowwise", "rowwise_split_input", "rowwise_rep"})


def style_placement(style: str, attr: str, ndim: int) -> tuple | None:
    """The DTensor placement ``shard_param`` of transformers style ``style`` gives a parameter
    named ``attr`` (the attribute on its module) of ``ndim`` dims: ``("shard", dim)``,
    ``("strided", dim, split_factor)`` or ``None`` (replicated). See Note [HF parallel styles].

    Raises:
        LayoutError: a style transformers 5 does not register.
    """
    last = max(ndim - 1, 0)
    if style in _COLWISE:
        return ("shard", ndim - 2 if ndim > 1 else 0)  # Shard(ndim - 2): Shard(-1) on a vector
    if style in _ROWWISE:
        return None if attr == "bias" else ("shard", last)
    if style == "embedding_rowwise":
        return ("shard", 0)
    if style == "embedding_colwise":
        return ("shard", 1)
    if style == "packed_colwise":
        return ("shard", last) if ndim == 1 else ("strided", ndim - 2, 2)
    if style == "packed_rowwise":
        return None if ndim == 1 else ("strided", last, 2)
    if style == "grouped_gemm":
        return ("shard", 0)
    if style in _UNSHARDED:
        return None
    raise LayoutError(f"{_FUNC}: style={style!r} is unknown; expected a transformers parallel style "
                      f"({sorted(_COLWISE | _ROWWISE | _UNSHARDED)} or embedding_*, packed_*, grouped_gemm)")


def _generic(name: str) -> str:
    # transformers' replace_layer_number_by_wildcard: numbers between dots (ModuleList indices) -> "*"
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def parameter_style(name: str, plan: dict[str, str]) -> str | None:
    """The style ``plan`` gives parameter ``name``: its own entry, else its module's
    (transformers' ``_get_parameter_plan(name, plan, is_weight=True)``)."""
    generic = _generic(name)
    if generic in plan:
        return plan[generic]
    module = generic.rsplit(".", 1)[0] if "." in generic else None
    return plan.get(module) if module is not None else None


def _plans(model: LogicalModel, tp: int, ep: int) -> tuple[dict[str, str], dict[str, str]]:
    """The TP and EP plans in force at this size (``DistributedMixin._resolve_parallel_plans``)."""
    tp_plan = dict(model.tp_plan) if tp > 1 else {}
    ep_plan = dict(model.ep_plan) if ep > 1 else {}
    for kind, size, plan in (("tp", tp, tp_plan), ("ep", ep, ep_plan)):
        if size > 1 and not plan:
            raise LayoutError(f"{_FUNC}: {kind}={size} but {model.dims.model_type!r} has no {kind}_plan; expected "
                              f"{kind}=1 (transformers refuses {kind}_size > 1 without base_model_{kind}_plan)")
    if ep_plan:
        is_expert = re.compile(rf"(?:{'|'.join(map(re.escape, ep_plan))})(?:\..+)?").fullmatch
        tp_plan = {k: v for k, v in tp_plan.items() if not is_expert(k)}
    return tp_plan, ep_plan


def _split_rows(placement: tuple, size: int, num: int, idx: int) -> list[int]:
    """The global indices along the sharded dim that rank ``idx`` of ``num`` holds, in local order:
    PyTorch's own split (``Placement._split_tensor``, what ``distribute_tensor`` runs) of an index
    vector, so chunk and strided semantics are PyTorch's, not restated."""
    import torch
    from torch.distributed.tensor.placement_types import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    split = TorchShard(0) if placement[0] == "shard" else _StridedShard(0, split_factor=placement[2])
    chunks, _ = split._split_tensor(torch.arange(size, device="cpu"), num, with_padding=False)
    return chunks[idx].tolist() if idx < len(chunks) else []


def _sharded(t: Logical, dtype: str, placement: tuple | None, num: int, idx: int) -> TensorLayout:
    """The local shard of ``t`` under ``placement`` on a mesh of ``num`` ranks, at ``idx``: one part
    per run of consecutive global rows (See Note [DTensor boxes] in ``refit.dtensor``)."""
    if placement is None or num == 1:
        return TensorLayout(t.name, dtype, (Part(t.name, Shard(t.shape)),))
    dim = placement[1]
    rows = _split_rows(placement, t.shape[dim], num, idx)
    runs = index_runs(rows) or [(0, 0, 0)]
    parts = []
    for local, start, n in runs:
        bounds = [(0, d) for d in t.shape]
        bounds[dim] = (start, start + n)
        offset = [0] * len(t.shape)
        offset[dim] = local
        parts.append(Part(t.name, Shard(t.shape, tuple(bounds)), tuple(offset)))
    shape = list(t.shape)
    shape[dim] = len(rows)
    return TensorLayout(t.name, dtype, tuple(parts), tuple(shape))


def layouts(
    model: LogicalModel, *, tp: int, rank: int, ep: int, ep_rank: int, **options: Any
) -> dict[str, TensorLayout]:
    """Every tensor a transformers rank holds at TP rank ``rank`` of ``tp`` and EP rank ``ep_rank``
    of ``ep``, under transformers' names (Note [HF parallel styles]). No options.

    Raises:
        LayoutError: an option, ``ep`` not a multiple of ``tp`` or experts ``ep`` does not divide
            (both refused by transformers), a size > 1 without a plan, an unknown style.
    """
    if options:
        raise LayoutError(f"{_FUNC}: options {sorted(options)} unknown; expected none (the hf convention has none)")
    if ep > 1 and ep % tp:
        raise LayoutError(f"{_FUNC}: ep={ep} is not a multiple of tp={tp}; expected ep % tp == 0 "
                          "(transformers' DistributedConfig: `ep_size` must be a multiple of `tp_size`)")
    tp_plan, ep_plan = _plans(model, tp, ep)
    out: dict[str, TensorLayout] = {}
    for t in model.tensors:
        attr = t.name.rsplit(".", 1)[-1]
        style, num, idx = None, 1, 0
        if not t.buffer:
            style = parameter_style(t.name, ep_plan) if ep_plan else None
            if style is not None:
                num, idx = ep, ep_rank
            else:
                style = parameter_style(t.name, tp_plan) if tp_plan else None
                num, idx = tp, rank
        try:
            placement = style_placement(style, attr, len(t.shape)) if style is not None else None
        except LayoutError as e:
            raise LayoutError(f"{_FUNC}: tensor {t.name!r}: {str(e).removeprefix(_FUNC + ': ')}") from None
        if style == "grouped_gemm" and t.shape[0] % ep:
            raise LayoutError(f"{_FUNC}: tensor {t.name!r}: num_experts={t.shape[0]} is not divisible by ep={ep}; "
                              "expected ep to divide the experts (transformers' MoEParamShard refuses uneven experts)")
        layout = _sharded(t, t.dtype, placement, num, idx)
        # ep > tp: the ep / tp ranks of one TP rank hold the same TP shards (Note [Replicated parts]
        # in refit.manifest); what the EP plan places is split over all ep ranks
        out[t.name] = layout.with_replicated() if ep > tp and num != ep else layout
    return out
