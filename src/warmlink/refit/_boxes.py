"""Covering and byte-run arithmetic for refit plans. Pure integer logic, no torch.

Boxes are those of ``warmlink._geometry``. Local tensors are C-contiguous, so the element stride of
dimension ``d`` is the product of the extents after it. A part with more dimensions than its
physical tensor (Note [Layout rules]) sees that tensor with leading 1s (``pad_shape``): the same
bytes, so runs are computed in the part's own number of dimensions.

A *raw run* is ``(src_offset, dst_offset, row_nbytes, num_rows, src_pitch, dst_pitch)`` in bytes,
with pitches 0 when ``num_rows == 1``; ``warmlink.refit.plan`` wraps them into ``Run`` objects.

``index_sources`` and ``cover`` (last section) choose, for every element of every destination
part, exactly one publisher part holding it. Internal to ``warmlink.refit``; not public API.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

from warmlink._geometry import Box, box_numel, box_shape, c_strides, intersect, subtract, translate
from warmlink.errors import LayoutError
from warmlink.refit.manifest import TensorLayout

RawRun = tuple[int, int, int, int, int, int]

__all__ = ["Box", "RawRun", "box_shape", "box_numel", "intersect", "subtract", "translate",
           "c_strides", "merge_boxes", "count_runs", "box_runs", "normalize_run", "merge_runs",
           "SourceLogical", "index_sources", "part_delta", "box_ordinal", "cover"]


def merge_boxes(pairs: list[tuple[Box, Box]]) -> list[tuple[Box, Box]]:
    """Merge ``(src_box, dst_box)`` pairs that share one translation and abut along one dimension.

    All pairs passed in must come from the same source tensor. Two pairs merge when
    ``dst - src`` is the same vector for both and their source boxes are equal in every dimension
    but one, where one ends where the other starts. Repeats until nothing merges; the result is
    sorted, so it does not depend on the input order.
    """
    groups: dict[tuple[int, ...], list[Box]] = {}
    for src, dst in pairs:
        delta = tuple(d0 - s0 for (s0, _), (d0, _) in zip(src, dst))
        groups.setdefault(delta, []).append(src)
    out: list[tuple[Box, Box]] = []
    for delta, boxes in groups.items():
        changed = True
        while changed and len(boxes) > 1:
            changed = False
            for d in range(len(delta)):
                boxes.sort(key=lambda b: (b[:d] + b[d + 1:], b[d]))
                merged = [boxes[0]]
                for b in boxes[1:]:
                    last = merged[-1]
                    if last[:d] == b[:d] and last[d + 1:] == b[d + 1:] and last[d][1] == b[d][0]:
                        merged[-1] = last[:d] + ((last[d][0], b[d][1]),) + last[d + 1:]
                        changed = True
                    else:
                        merged.append(b)
                boxes = merged
        out.extend((b, translate(b, delta)) for b in boxes)
    return sorted(out)


def _groups(src_box: Box, src_shape: Sequence[int], dst_box: Box, dst_shape: Sequence[int]) -> list[list[int]]:
    """Coalesced ``[extent, src_stride, dst_stride]`` groups, outermost first, strides in elements.

    Dimensions of extent 1 only shift the offset and are dropped. An outer dimension folds into the
    group inside it when its strides equal that group's extent times its strides on both sides
    (the box spans the whole inner group on both sides), as torch coalesces dimensions.
    """
    ss, ds = c_strides(src_shape), c_strides(dst_shape)
    groups: list[list[int]] = []  # innermost first while building
    for d in reversed(range(len(src_box))):
        ext = src_box[d][1] - src_box[d][0]
        if ext == 1:
            continue
        if groups and ss[d] == groups[-1][0] * groups[-1][1] and ds[d] == groups[-1][0] * groups[-1][2]:
            groups[-1][0] *= ext
        else:
            groups.append([ext, ss[d], ds[d]])
    return groups[::-1]


def _split(groups: list[list[int]]) -> tuple[int, list[int] | None, list[list[int]]]:
    """(contiguous chunk in elements, row group or None, outer groups) of coalesced groups."""
    if groups and groups[-1][1] == 1 and groups[-1][2] == 1:
        chunk, rest = groups[-1][0], groups[:-1]
    else:
        chunk, rest = 1, groups
    if rest:
        return chunk, rest[-1], rest[:-1]
    return chunk, None, []


def count_runs(src_box: Box, src_shape: Sequence[int], dst_box: Box, dst_shape: Sequence[int]) -> int:
    """How many raw runs ``box_runs`` yields for one box, without building them."""
    _, _, outer = _split(_groups(src_box, src_shape, dst_box, dst_shape))
    n = 1
    for ext, _, _ in outer:
        n *= ext
    return n


def box_runs(
    src_box: Box, src_shape: Sequence[int], dst_box: Box, dst_shape: Sequence[int], itemsize: int
) -> Iterator[RawRun]:
    """Byte runs copying ``src_box`` of a C-contiguous source into ``dst_box`` of a destination.

    Args:
        src_box, dst_box: equally shaped non-empty boxes in each tensor's local element coordinates.
        src_shape, dst_shape: local shapes of the two tensors, in elements.
        itemsize: bytes per element.

    Yields:
        Raw runs: the contiguous chunk is the innermost coalesced group (one element when the
        innermost dimension is cut on either side), the next group outward becomes rows (a 2-D
        run), every further group multiplies into separate runs.
    """
    ss, ds = c_strides(src_shape), c_strides(dst_shape)
    src_base = sum(b[0] * s for b, s in zip(src_box, ss)) * itemsize
    dst_base = sum(b[0] * s for b, s in zip(dst_box, ds)) * itemsize
    chunk, rows, outer = _split(_groups(src_box, src_shape, dst_box, dst_shape))
    row_nbytes = chunk * itemsize
    num_rows, sp, dp = (rows[0], rows[1] * itemsize, rows[2] * itemsize) if rows else (1, 0, 0)
    for idx in itertools.product(*(range(g[0]) for g in outer)):
        so = src_base + sum(i * g[1] for i, g in zip(idx, outer)) * itemsize
        do = dst_base + sum(i * g[2] for i, g in zip(idx, outer)) * itemsize
        yield normalize_run((so, do, row_nbytes, num_rows, sp, dp))


def normalize_run(r: RawRun) -> RawRun:
    """Canonical form: one row has zero pitches; rows that chain contiguously become one row."""
    so, do, row, n, sp, dp = r
    if n == 1:
        return (so, do, row, 1, 0, 0)
    if sp == row and dp == row:
        return (so, do, row * n, 1, 0, 0)
    return r


def merge_runs(a: RawRun, b: RawRun) -> RawRun | None:
    """``a`` followed by ``b`` as one run, or ``None``. Both read the same source, ``a`` first.

    Two cases: two single rows contiguous on both sides (one longer row); equal rows where ``b``
    continues the row sequence of a 2-D ``a`` or ``b`` with the same pitches (more rows). Two
    unrelated single rows never become a 2-D run: 1-D copies batch better than strided ones.
    """
    aso, ado, arow, an, asp, adp = a
    bso, bdo, brow, bn, bsp, bdp = b
    if an == 1 and bn == 1 and aso + arow == bso and ado + arow == bdo:
        return normalize_run((aso, ado, arow + brow, 1, 0, 0))
    if arow != brow:
        return None
    if an > 1 and bn > 1 and (asp, adp) != (bsp, bdp):
        return None
    if an > 1:
        sp, dp = asp, adp
    elif bn > 1:
        sp, dp = bsp, bdp
    else:
        return None
    if aso + an * sp == bso and ado + an * dp == bdo:
        return normalize_run((aso, ado, arow, an + bn, sp, dp))
    return None


# -- covering destination parts with publisher parts (See Note [Replica choice] in plan.py) -----
Holder = tuple[int, str, int]  # (rank, physical tensor, part index)


@dataclass
class SourceLogical:
    """Everything the publishers hold of one logical tensor."""

    global_shape: tuple[int, ...]
    dtype: str
    first: tuple[int, str]  # (rank, tensor) that fixed global_shape and dtype, for error messages
    holders: dict[Box, list[Holder]]  # sorted non-empty box -> sorted holders
    deltas: dict[Holder, tuple[int, ...]]  # global-to-local shift, in the part's dims
    # Holders whose part is neither marked replicated nor the whole tensor: by their layouts, no
    # other part holds their elements (Note [Replicated parts] in refit.manifest).
    exclusive: set[Holder] = field(default_factory=set)


def part_delta(part) -> tuple[int, ...]:
    """Global -> local element shift per dimension of ``part`` (its offset, with leading 0s for the
    dimensions its physical tensor squeezes)."""
    offset = (0,) * (len(part.shard.bounds) - len(part.offset)) + tuple(part.offset)
    return tuple(o - start for o, (start, _) in zip(offset, part.shard.bounds))


def box_ordinal(box: Box, global_shape: Sequence[int]) -> int:
    """Which shard a box is along the dimensions it cuts (``start // extent``, summed): differs
    between the receivers of one tensor, so that their replica choices spread."""
    return sum(start // (stop - start) for (start, stop), size in zip(box, global_shape) if 0 < stop - start < size)


def index_sources(sources: Mapping[int, Sequence[TensorLayout]]) -> dict[str, SourceLogical]:
    """Group every publisher part by logical name; LayoutError when shapes or dtypes disagree."""
    index: dict[str, SourceLogical] = {}
    wholes: dict[str, Box] = {}
    for rank in sorted(sources):
        for t in sources[rank]:
            for pi, part in enumerate(t.parts):
                gs = part.shard.global_shape
                ent = index.setdefault(part.logical, SourceLogical(gs, t.dtype, (rank, t.name), {}, {}))
                if ent.global_shape != gs:
                    raise LayoutError(
                        f"build_plan: global_shape={gs!r} of logical={part.logical!r} in rank={rank} tensor={t.name!r} "
                        f"differs across publishers; expected {ent.global_shape!r} as in rank={ent.first[0]} "
                        f"tensor={ent.first[1]!r}"
                    )
                if ent.dtype != t.dtype:
                    raise LayoutError(
                        f"build_plan: dtype={t.dtype!r} of logical={part.logical!r} in rank={rank} tensor={t.name!r} "
                        f"differs across publishers; expected {ent.dtype!r} as in rank={ent.first[0]} "
                        f"tensor={ent.first[1]!r} (publish one dtype per logical tensor)"
                    )
                if part.perm is not None:  # See Note [Transposed parts] in refit.manifest
                    raise LayoutError(
                        f"build_plan: logical={part.logical!r} in rank={rank} tensor={t.name!r} is transposed "
                        f"(perm={part.perm}); expected source layouts without perm (transposed parts are receiver-only)"
                    )
                box = part.shard.bounds
                if box_numel(box) == 0:
                    continue  # an empty box holds nothing anyone can read
                ent.holders.setdefault(box, []).append((rank, t.name, pi))
                ent.deltas[(rank, t.name, pi)] = part_delta(part)
                if not part.replicated:
                    whole = wholes.get(part.logical)
                    if whole is None:
                        whole = wholes[part.logical] = tuple((0, d) for d in gs)
                    if box != whole:
                        ent.exclusive.add((rank, t.name, pi))
    for ent in index.values():
        ent.holders = {box: sorted(ent.holders[box]) for box in sorted(ent.holders)}
    return index


def cover(
    ti: int, dst: TensorLayout, index: dict[str, SourceLogical], name_map: Mapping[str, str],
) -> tuple[str, dict[tuple[int, str], list[tuple[Box, Box]]]]:
    """(source dtype, {(rank, tensor): [(src_local_box, dst_local_box)]}) covering every part of ``dst``
    exactly once. Local boxes have the dimensions of the logical tensor they came from."""
    src_dtype: str | None = None
    by_src: dict[tuple[int, str], list[tuple[Box, Box]]] = {}
    checked: list[tuple[str, SourceLogical]] = []
    for part in dst.parts:
        logical = name_map.get(part.logical, part.logical)
        ent = index.get(logical)
        where = f"dst tensor={dst.name!r} logical={part.logical!r}"
        if ent is None:
            known = sorted(index)
            raise LayoutError(
                f"build_plan: logical={logical!r} missing from every publisher ({where}); expected one of "
                f"{known[:20]}{' ...' if len(known) > 20 else ''} (check the names or pass name_map)"
            )
        if ent.global_shape != part.shard.global_shape:
            raise LayoutError(
                f"build_plan: global_shape={part.shard.global_shape!r} does not match the publishers' "
                f"{ent.global_shape!r} ({where}); expected equal global shapes"
            )
        if src_dtype is not None and ent.dtype != src_dtype:
            raise LayoutError(
                f"build_plan: dtype={ent.dtype!r} of source logical={logical!r} differs from {src_dtype!r} of an "
                f"earlier part ({where}); expected one source dtype per destination tensor"
            )
        src_dtype = ent.dtype
        checked.append((logical, ent))
    # Sources this tensor must read anyway (sole holders of a box it needs): replicas prefer them.
    used = {
        hs[0][:2]: None
        for part, (_, ent) in zip(dst.parts, checked)
        for box, hs in ent.holders.items()
        if len(hs) == 1 and intersect(part.shard.bounds, box) is not None
    }
    for part, (logical, ent) in zip(dst.parts, checked):
        where = f"dst tensor={dst.name!r} logical={part.logical!r}"
        dst_box = part.shard.bounds
        dst_delta = part_delta(part)
        remaining = [] if box_numel(dst_box) == 0 else [dst_box]
        for box, hs in ent.holders.items():
            if not remaining:
                break
            if all(intersect(r, box) is None for r in remaining):
                continue
            preferred = [h for h in hs if h[:2] in used]  # See Note [Replica choice]
            spread = ti + box_ordinal(dst_box, part.shard.global_shape)
            rank, name, spi = preferred[0] if preferred else hs[spread % len(hs)]
            used[(rank, name)] = None
            src_delta = ent.deltas[(rank, name, spi)]
            left = []
            for r in remaining:
                inter = intersect(r, box)
                if inter is None:
                    left.append(r)
                    continue
                pair = (translate(inter, src_delta), translate(inter, dst_delta))
                by_src.setdefault((rank, name), []).append(pair)
                left.extend(subtract(r, inter))
            remaining = left
        if remaining:
            total = sum(box_numel(b) for b in remaining)
            raise LayoutError(
                f"build_plan: box={remaining[0]!r} uncovered by every publisher ({where}, global coordinates; "
                f"{total} elements uncovered in {len(remaining)} boxes); expected the publishers' shards of "
                f"{logical!r} to cover the destination part (is a publisher rank missing?)"
            )
    assert src_dtype is not None, "TensorLayout guarantees at least one part"
    return src_dtype, {k: merge_boxes(v) for k, v in by_src.items()}
