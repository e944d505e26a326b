"""Where FP8 scales live: which scale cells a box of a weight needs, the scale tensor that holds
them, and the plan-time checks that keep values and scales together. Pure layout logic, no torch.

A quantized weight of logical name ``W`` and global shape ``(*lead, N, K)`` travels as two logical
tensors: ``W`` in float8_e4m3fn, same shape, and its scales ``W + suffix`` in float32, one per
*cell* (vLLM's names and shapes, Note [FP8 formats] in ``refit.fp8``):

* ``block``: ``W_scale_inv`` ``(*lead, ceil(N / 128), ceil(K / 128))``, a cell per 128 x 128 block;
* ``channel``: ``W_scale`` ``(*lead, N, 1)``, a cell per output row;
* ``tensor``: ``W_scale`` ``(1,)``, one cell for the whole tensor (2-D weights only).

A box of ``W`` needs the cells it touches (``cell_box``), and it *holds* them when every element of
those cells is inside it (``holds_cells``): a block box cut at multiples of 128 (or at the edge), a
channel box of whole rows, a tensor box of all of ``W``. Only a holder can compute its cells' scales
alone (Note [Where FP8 is quantized] in ``refit.fp8``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from warmlink._geometry import Box, box_numel
from warmlink.errors import ConfigError, LayoutError
from warmlink.refit.manifest import Part, Shard, TensorLayout

__all__ = ["SCHEMES", "BLOCK", "FP8_MAX", "VALUES_DTYPE", "is_fp8", "check_scheme", "scale_name",
           "scale_global_shape", "cell_box", "holds_cells", "values_layout", "scale_layout", "check_scales"]

SCHEMES = ("block", "channel", "tensor")
BLOCK = (128, 128)  # (rows, cols) of one block: what vLLM's FP8 checkpoints and kernels use
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
VALUES_DTYPE = "float8_e4m3fn"
_SUFFIX = {"block": "_scale_inv", "channel": "_scale", "tensor": "_scale"}


def is_fp8(dtype: str) -> bool:
    """Whether wire dtype ``dtype`` is an FP8 one (values that mean nothing without their scales)."""
    return dtype.startswith("float8")


def check_scheme(scheme, func: str) -> str:
    if scheme not in SCHEMES:
        raise ConfigError(f"{func}: scheme={scheme!r} is unknown; expected one of {list(SCHEMES)}")
    return scheme


def scale_name(name: str, scheme: str) -> str:
    """The name of ``name``'s scales: ``weight`` -> ``weight_scale_inv`` (block) or ``weight_scale``."""
    return name + _SUFFIX[scheme]


def scale_global_shape(global_shape: Sequence[int], scheme: str) -> tuple[int, ...]:
    """The global shape of the scales of a weight of ``global_shape`` (see the module docstring)."""
    *lead, n, k = global_shape
    if scheme == "tensor":
        return (1,)
    if scheme == "channel":
        return (*lead, n, 1)
    return (*lead, -(-n // BLOCK[0]), -(-k // BLOCK[1]))


def cell_box(box: Box, global_shape: Sequence[int], scheme: str) -> Box:
    """The scale cells a box of a weight touches, as a box of its scales (empty for an empty box)."""
    if box_numel(box) == 0:
        return tuple((0, 0) for _ in scale_global_shape(global_shape, scheme))
    if scheme == "tensor":
        return ((0, 1),)
    *lead, (r0, r1), (c0, c1) = box
    if scheme == "channel":
        return (*lead, (r0, r1), (0, 1))
    return (*lead, (r0 // BLOCK[0], -(-r1 // BLOCK[0])), (c0 // BLOCK[1], -(-c1 // BLOCK[1])))


def holds_cells(box: Box, global_shape: Sequence[int], scheme: str) -> bool:
    """Whether ``box`` holds every element of the cells it touches (its scales need nobody else)."""
    if box_numel(box) == 0:
        return True
    if scheme == "tensor":
        return all(a == 0 and b == g for (a, b), g in zip(box, global_shape))
    (c0, c1), k = box[-1], global_shape[-1]
    if scheme == "channel":
        return (c0, c1) == (0, k)
    return all(a % blk == 0 and (b % blk == 0 or b == g)
               for (a, b), g, blk in zip(box[-2:], global_shape[-2:], BLOCK))


def values_layout(layout: TensorLayout) -> TensorLayout:
    """``layout`` holding FP8 values: the same parts, dtype float8_e4m3fn."""
    return TensorLayout(layout.name, VALUES_DTYPE, layout.parts, layout.shape)


def scale_layout(layout: TensorLayout, scheme: str, func: str = "fp8.scale_layout") -> TensorLayout:
    """The scales of the weights ``layout`` holds, as the tensor that holds them beside it (named
    ``scale_name(layout.name, scheme)``): block and channel cells placed as their weight parts are
    (offsets divided by the block), tensor cells one per logical weight in order of appearance (vLLM's
    ``weight_scale`` of a fused module, one per partition). A scale part whose weight part does not
    hold its cells is marked replicated: other ranks hold (parts of) those cells too, and after the
    reduction the same scales (Note [Where FP8 is quantized] in ``refit.fp8``).

    Raises:
        LayoutError: a weight of fewer than 2 dims, a transposed part, a tensor-scheme weight of more
            than 2 dims, or a block part placed off a multiple of 128 (its cells would straddle
            another part's), naming the tensor and the part.
    """
    name = scale_name(layout.name, scheme)
    for p in layout.parts:
        where = f"{func}: tensor {layout.name!r} part of logical={p.logical!r}"
        if len(p.shard.global_shape) < 2 or (len(p.offset) < 2 and scheme != "tensor"):
            raise LayoutError(f"{where} has global_shape={p.shard.global_shape} in a {len(p.offset)}-d tensor; expected "
                              "a weight of 2 or more dims (FP8 scales are per block, row or tensor of a matrix)")
        if p.perm is not None:
            raise LayoutError(f"{where} is transposed (perm={p.perm}); expected an untransposed weight (FP8 scales of "
                              "transposed experts are not described)")
        if scheme == "tensor" and len(p.shard.global_shape) > 2:
            raise LayoutError(f"{where} has global_shape={p.shard.global_shape}; expected a 2-D weight for "
                              "scheme='tensor' (vLLM's per-tensor expert scales are per expert and per gate/up half: "
                              "use scheme='block' or 'channel')")
    if scheme == "tensor":
        firsts: dict[str, Part] = {}
        for p in layout.parts:
            firsts.setdefault(p.logical, p)
        parts = tuple(Part(scale_name(lg, scheme), Shard((1,)), (i,), replicated=not _whole(lg, layout))
                      for i, lg in enumerate(firsts))
        return TensorLayout(name, "float32", parts, (len(parts),))
    parts = []
    for p in layout.parts:
        gs, box = p.shard.global_shape, p.shard.bounds
        offset = tuple(p.offset)
        if scheme == "block":
            if offset[-2] % BLOCK[0] or offset[-1] % BLOCK[1]:
                raise LayoutError(
                    f"{func}: tensor {layout.name!r} places logical={p.logical!r} at offset={offset}; expected offsets "
                    f"of the last two dims at multiples of {BLOCK} (a 128 x 128 block holds one logical tensor, as "
                    "vLLM requires of fused partitions)")
            offset = (*offset[:-2], offset[-2] // BLOCK[0], offset[-1] // BLOCK[1])
        else:
            offset = (*offset[:-1], 0)
        shard = Shard(scale_global_shape(gs, scheme), cell_box(box, gs, scheme))
        parts.append(Part(scale_name(p.logical, scheme), shard, offset,
                          replicated=p.replicated or not holds_cells(box, gs, scheme)))
    *lead, n, k = layout.shape
    shape = (*lead, -(-n // BLOCK[0]), -(-k // BLOCK[1])) if scheme == "block" else (*lead, n, 1)
    try:
        return TensorLayout(name, "float32", tuple(parts), shape)
    except LayoutError as e:  # two parts whose cells share a place: a block or row split between parts
        raise LayoutError(f"{func}: the scales of tensor {layout.name!r} cannot be laid out ({e}); expected each "
                          "part's cells apart from the others'") from None


def _whole(logical: str, layout: TensorLayout) -> bool:
    parts = [p for p in layout.parts if p.logical == logical]
    return sum(p.shard.numel for p in parts) == box_numel(tuple((0, g) for g in parts[0].shard.global_shape))


# Note [FP8 versions]
# Values and scales are two published tensors of one version: a receiver pulls both in one cycle
# under one version sync and installs them together, so they never mix versions as long as it
# declares both. ``build_plan`` makes that a rule (``check_scales``): a destination part that takes
# FP8 values of logical ``W`` must come with destination parts that take every scale cell of the
# box it takes (``W_scale_inv`` or ``W_scale``, whichever the publishers send). A receiver that
# declared the values alone would install this version's values beside an older version's scales:
# refused by name before any byte moves. A cast between FP8 and any other dtype is refused too: it
# would drop (or invent) the scales, so FP8 reaches an engine only as values with their scales.
def check_scales(index: Mapping[str, object], targets: Sequence[TensorLayout], name_map: Mapping[str, str]) -> None:
    """Refuse, before any byte moves, a plan that casts FP8 or takes FP8 values without their scales
    (Note [FP8 versions]).

    Args:
        index: publisher logical name -> an object with ``dtype`` (wire name) and ``global_shape``
            (``refit._boxes.SourceLogical``).
        targets: the receiver's layouts; ``name_map``: destination logical -> publisher logical.

    Raises:
        LayoutError: naming the destination tensor, the logical and what is missing.
    """
    taken: dict[str, list[Box]] = {}  # publisher logical -> boxes the targets take of it
    for t in targets:
        for p in t.parts:
            taken.setdefault(name_map.get(p.logical, p.logical), []).append(p.shard.bounds)
    for t in targets:
        for p in t.parts:
            logical = name_map.get(p.logical, p.logical)
            ent = index.get(logical)
            if ent is None:
                continue  # build_plan names a logical no publisher holds
            where = f"build_plan: dst tensor={t.name!r} logical={p.logical!r}"
            if is_fp8(ent.dtype) != is_fp8(t.dtype):
                raise LayoutError(
                    f"{where} is {t.dtype!r} but the publishers send {logical!r} in {ent.dtype!r}; expected FP8 on both "
                    "sides or neither (a cast would drop the scales: declare the FP8 values with their scales, as "
                    "families.layouts(..., fp8=scheme) does, or publish without fp8=)")
            if not is_fp8(ent.dtype):
                continue
            scheme, scales = _published_scales(index, logical, ent.global_shape, where)
            need = cell_box(p.shard.bounds, ent.global_shape, scheme)
            if box_numel(need) and not any(_contains(b, need) for b in taken.get(scales, ())):
                raise LayoutError(
                    f"{where} takes FP8 values of {logical!r} (box={p.shard.bounds}) but no destination tensor takes "
                    f"their scales {scales!r} (cells {need}); expected both declared, so that they install in one "
                    "version (Note [FP8 versions]; families.layouts(..., fp8=scheme) declares both)")


def _published_scales(index: Mapping[str, object], logical: str, global_shape, where: str) -> tuple[str, str]:
    """``(scheme, scale logical)`` the publishers send beside FP8 ``logical``."""
    for scheme in SCHEMES:
        scales = scale_name(logical, scheme)
        ent = index.get(scales)
        if ent is not None and ent.global_shape == scale_global_shape(global_shape, scheme):
            return scheme, scales
    raise LayoutError(f"{where}: the publishers send {logical!r} in FP8 without scales of its shape "
                      f"({scale_name(logical, 'block')!r} or {scale_name(logical, 'channel')!r}); expected them beside "
                      "it (Publisher.add(..., fp8=) publishes both)")


def _contains(outer: Box, inner: Box) -> bool:
    return len(outer) == len(inner) and all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))
