"""Box geometry shared by the layout model (``refit.manifest``) and the wire schema
(``rendezvous.schema``): one set of rules for what a physical tensor may hold, checked on both
sides of the store. Pure integer logic; imports nothing from warmlink but nothing at all.

A *box* is a tuple of ``(start, stop)`` per dimension, half-open, in element coordinates; it is
*empty* when any dimension has ``stop <= start``.

# Note [Layout rules]
A physical tensor of shape ``shape`` holds *parts*. A part is a box of one logical tensor (its
``bounds``, in the logical tensor's global coordinates) placed at ``offset`` in the physical
tensor. The rules, checked by ``layout_problem``:

* ``0 <= start <= stop <= global_shape[d]`` in every dimension (an empty box is allowed: a rank
  may hold nothing of a tensor, as ``torch.chunk`` gives 6 experts over 4 ranks as [2, 2, 2, 0]).
* A part may have more dimensions than the physical tensor: its leading ``k`` extra dimensions
  must then have extent 1 (or the part is empty) and are squeezed (one expert of a 3-D expert
  tensor stored as a 2-D matrix, as Megatron's per-expert ``linear_fc1`` is).
* ``offset[d] + extent[d] <= shape[d]`` in the physical tensor's own dimensions.
* Non-empty parts never overlap in the physical tensor, and two non-empty parts of the same
  logical tensor never overlap in global coordinates (one element, one place).
* Every part of one logical tensor agrees on its ``global_shape``.
* A part may be *transposed* (Note [Transposed parts] in ``refit.manifest``): its ``perm``, a
  permutation of the physical tensor's dimensions, says which (unsqueezed) box dimension each
  physical dimension holds, and extents are checked in that order.

Elements of the physical tensor that no part covers are *padding*: never sent, never compared.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

__all__ = ["Box", "box_shape", "box_numel", "intersect", "subtract", "translate", "c_strides",
           "pad_shape", "layout_problem"]

Box = tuple[tuple[int, int], ...]


# Plans call these hundreds of thousands of times: list comprehensions and plain loops, which
# CPython runs several times faster than generator expressions.
def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of ``box`` per dimension, in elements (negative extents clamp to 0)."""
    return tuple([stop - start if stop > start else 0 for start, stop in box])


def box_numel(box: Box) -> int:
    """Number of elements inside ``box`` (1 for the 0-d box ``()``)."""
    n = 1
    for start, stop in box:
        n *= stop - start if stop > start else 0
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """``a`` intersected with ``b``; ``None`` when the intersection is empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        start, stop = a0 if a0 > b0 else b0, a1 if a1 < b1 else b1
        if stop <= start:
            return None
        out.append((start, stop))
    return tuple(out)


def subtract(a: Box, inner: Box) -> list[Box]:
    """``a`` minus ``inner`` (``inner`` must lie inside ``a``) as at most ``2 * ndim`` disjoint boxes.

    Slab decomposition: for each dimension in turn, the slabs before and after ``inner`` along it,
    with the dimensions already handled restricted to ``inner``.
    """
    out: list[Box] = []
    cur = list(a)
    for d, ((a0, a1), (i0, i1)) in enumerate(zip(a, inner)):
        if a0 < i0:
            out.append(tuple(cur[:d] + [(a0, i0)] + cur[d + 1:]))
        if i1 < a1:
            out.append(tuple(cur[:d] + [(i1, a1)] + cur[d + 1:]))
        cur[d] = (i0, i1)
    return out


def translate(box: Box, delta: Sequence[int]) -> Box:
    """``box`` moved by ``delta`` elements per dimension."""
    return tuple([(start + s, stop + s) for (start, stop), s in zip(box, delta)])


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    try:
        return _c_strides(shape)
    except TypeError:  # unhashable (a list)
        return _c_strides.__wrapped__(shape)


@lru_cache(maxsize=1024, typed=True)  # plans ask again and again for the same few shapes
def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    strides.reverse()
    return tuple(strides)


def pad_shape(shape: Sequence[int], ndim: int) -> tuple[int, ...]:
    """``shape`` with leading 1s up to ``ndim`` dimensions: the same bytes, seen as a part sees them."""
    if len(shape) == ndim and type(shape) is tuple:
        return shape
    return (1,) * (ndim - len(shape)) + tuple(shape)


def _placed(bounds: Box, offset: Sequence[int], perm: Sequence[int] | None = None) -> Box:
    """Where a part's box lies in the physical tensor (squeezed leading dimensions dropped; a
    transposed part's extents in ``perm`` order)."""
    k = len(bounds) - len(offset)
    kept = bounds[k:] if perm is None else tuple(bounds[k + p] for p in perm)
    return tuple((o, o + max(0, stop - start)) for (start, stop), o in zip(kept, offset))


def _first_overlap(boxes: list[tuple[Box, int]]) -> tuple[int, int] | None:
    """Indices of two overlapping boxes (each given with its index), or None. Sweep along dim 0."""
    if not boxes:
        return None
    if not boxes[0][0]:  # 0-d: any two boxes are the same single element
        return (boxes[0][1], boxes[1][1]) if len(boxes) > 1 else None
    order = sorted(boxes, key=lambda bi: bi[0][0])
    active: list[tuple[Box, int]] = []
    for box, i in order:
        start = box[0][0]
        active = [(b, j) for b, j in active if b[0][1] > start]
        for b, j in active:
            if intersect(b, box) is not None:
                return (min(i, j), max(i, j))
        active.append((box, i))
    return None


# Structures of layouts found valid, logical names replaced by their first part's index: a model
# repeats a few dozen structures over tens of thousands of tensors. The rules depend on names only
# through which parts share one, so an equal key means an equal verdict. Bounded; valid ones only.
_valid: set = set()
_MAX_VALID = 1 << 14


def _structure(shape: Sequence[int], parts: Sequence[tuple[str, Sequence[int], Box, Sequence[int]]]):
    """A hashable key of everything ``layout_problem`` looks at, or None (unhashable input)."""
    try:
        # A transposed part's perm is a 5th item (Note [Transposed parts] in refit.manifest).
        if len(parts) == 1:
            _, gs, bounds, offset, *perm = parts[0]
            key = (tuple(shape), tuple(gs), tuple(bounds), tuple(offset), *(_perm_key(p) for p in perm))
        else:
            names: dict = {}
            key = (tuple(shape), tuple((names.setdefault(lg, len(names)), tuple(gs), tuple(b), tuple(o),
                                        *(_perm_key(p) for p in perm))
                                       for lg, gs, b, o, *perm in parts))
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


def _perm_key(perm) -> tuple | None:
    return None if perm is None else tuple(perm)


def layout_problem(
    shape: Sequence[int],
    parts: Sequence[tuple[str, Sequence[int], Box, Sequence[int]]],
) -> str | None:
    """The first way ``parts`` break Note [Layout rules] in a physical tensor of ``shape``, or None.

    Args:
        shape: the physical tensor's shape, in elements.
        parts: ``(logical, global_shape, bounds, offset)`` per part, or ``(..., offset, perm)`` for
            a transposed part (``perm`` None: not transposed).

    Returns:
        ``None`` when the layout is valid, else one sentence naming the part and field, for the
        caller to raise as its own error type (``LayoutError``, ``MetadataError``).
    """
    key = _structure(shape, parts)
    if key is not None and key in _valid:
        return None
    problem = _problem(shape, parts)
    if problem is None and key is not None:
        if len(_valid) >= _MAX_VALID:
            _valid.clear()
        _valid.add(key)
    return problem


def _problem(shape: Sequence[int], parts: Sequence[tuple[str, Sequence[int], Box, Sequence[int]]]) -> str | None:
    ndim = len(shape)
    if any(d < 0 for d in shape):
        return f"shape={tuple(shape)} has a negative dimension"
    logical_shapes: dict[str, tuple[int, ...]] = {}
    placed: list[tuple[Box, int]] = []
    by_logical: dict[str, list[tuple[Box, int]]] = {}
    for i, (logical, global_shape, bounds, offset, *rest) in enumerate(parts):
        where = f"parts[{i}] (logical={logical!r})"
        gshape = tuple(global_shape)
        perm = rest[0] if rest else None
        if len(bounds) != len(gshape):
            return f"{where}: bounds has {len(bounds)} dims but global_shape={gshape} has {len(gshape)}"
        if len(offset) != ndim:
            return f"{where}: offset={tuple(offset)} has {len(offset)} dims; expected {ndim}, as shape={tuple(shape)}"
        if len(gshape) < ndim:
            return f"{where}: global_shape={gshape} has fewer dims than shape={tuple(shape)}"
        for d, ((start, stop), size) in enumerate(zip(bounds, gshape)):
            if not 0 <= start <= stop <= size:
                return f"{where}: bounds[{d}]=({start}, {stop}) out of range; expected 0 <= start <= stop <= {size}"
        empty = any(stop <= start for start, stop in bounds)
        k = len(gshape) - ndim
        if not empty and any(stop - start != 1 for start, stop in bounds[:k]):
            return (f"{where}: bounds={tuple(bounds)} squeezes {k} leading dims of extent != 1; expected extent 1 "
                    f"where the part has more dims than shape={tuple(shape)}")
        if perm is not None and sorted(perm) != list(range(ndim)):
            return f"{where}: perm={tuple(perm)} invalid; expected a permutation of range({ndim}), as shape={tuple(shape)}"
        kept = bounds[k:] if perm is None else tuple(bounds[k + p] for p in perm)
        for d, (o, (start, stop)) in enumerate(zip(offset, kept)):
            if o < 0 or o + (stop - start) > shape[d]:
                return (f"{where}: offset[{d}]={o} + extent {stop - start} exceeds shape[{d}]={shape[d]}; "
                        "expected the part inside its physical tensor")
        prior = logical_shapes.setdefault(logical, gshape)
        if prior != gshape:
            return f"{where}: global_shape={gshape} differs from {prior} of an earlier part of the same logical tensor"
        if not empty:
            placed.append((_placed(tuple(bounds), offset, perm), i))
            by_logical.setdefault(logical, []).append((tuple(bounds), i))
    hit = _first_overlap(placed)
    if hit is not None:
        return f"parts[{hit[0]}] and parts[{hit[1]}] overlap in the physical tensor; expected disjoint parts"
    for logical, boxes in by_logical.items():
        hit = _first_overlap(boxes) if len(boxes) > 1 else None
        if hit is not None:
            return (f"parts[{hit[0]}] and parts[{hit[1]}] hold overlapping boxes of logical={logical!r}; "
                    "expected each element of a logical tensor once per physical tensor")
    return None
