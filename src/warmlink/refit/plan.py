"""Refit plans: which bytes of which publisher tensors land where in each receiver tensor.

``build_plan`` intersects the two sides' shard boxes in global coordinates (``refit.manifest``),
picks one source for every destination element, and turns each intersection into byte runs
(``_boxes``), coalesced, with a cap on runs per destination tensor past which whole source
tensors are pulled into scratch and sliced locally. Pure logic: nothing here touches memory.

# Note [Replica choice]
Several publisher tensors may hold the same box of a logical tensor where their layouts say the
framework keeps it on several ranks (Note [Replicated parts] in ``refit.manifest``: GQA KV heads
when TP > num_kv_heads, data-parallel replicas, and any whole tensor, such as a replicated norm).
Everywhere else, two source parts holding one element (the same box or overlapping ones, on two
ranks or in two tensors of one) is a ``LayoutError`` naming the logical tensor, the boxes and both
holders, raised by ``build_plan`` before any byte moves (``_check_replicas``). The choice below
reads each element from one holder and trusts the others to hold the same bytes: true of
replicas, false of two trainer ranks built with the same ``rank=``, which publish the same shard
with different bytes (a receiver would install the other rank's bytes for some tensors, silently).
Holders of one box are sorted by (rank, tensor name, part index).
A destination tensor first prefers a holder it already reads from (the sole holder of another box
it needs, or a replica it chose earlier; the lowest such in that order), so a fused ``[q; k; v]``
in a matching layout reads from one rank and coalesces. Otherwise a destination part of the
``t``-th target tensor whose box is shard ``s`` along the dimensions it cuts (``_boxes.box_ordinal``)
reads from holder ``(t + s) % num_holders``, which spreads different tensors and different
receiver shards over the holders. The choice depends only
on the inputs, so it is the same in every process. Partly overlapping distinct boxes are taken in
sorted box order, each covering only what the ones before it left.

# Note [Run cap]
A destination tensor may need at most ``max_runs_per_tensor`` link copies (runs plus staged pulls).
Past that, source tensors are staged greedily, the one needing the most runs first (ties by rank,
then name): one contiguous pull of the whole source tensor into scratch, then local slicing. A
source needing more than the cap on its own is staged without building its runs. When a tensor
reads from more source tensors than the cap, staging cannot help and it keeps one copy per source.
A transposed destination part (Note [Transposed parts] in ``refit.manifest``) is always staged:
each source box it reads is pulled compactly by its own runs when at most the cap of them fetch it,
else the whole source tensor in one copy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Mapping, NoReturn, Sequence

from warmlink._dtypes import dtype_size
from warmlink._geometry import pad_shape
from warmlink.errors import ConfigError, LayoutError
from warmlink.refit import _boxes
from warmlink.refit._boxes import Box
from warmlink.refit._fp8_layout import check_scales
from warmlink.refit.manifest import Part, Shard, TensorLayout

__all__ = ["Run", "StagedPull", "TensorPlan", "Plan", "build_plan", "layout_signature",
           "qkv_layout", "gate_up_layout", "SCRATCH_ALIGN_BYTES"]

#: Staged pulls start at multiples of this many bytes inside a tensor's scratch space.
SCRATCH_ALIGN_BYTES = 256
_SIGNATURE_VERSION = "warmlink.refit.plan/2"


@dataclass(frozen=True, slots=True)
class Run:
    """Copy num_rows rows of row_nbytes bytes; row i goes from src_offset + i*src_pitch to dst_offset + i*dst_pitch.

    Offsets and pitches are bytes: ``src_offset`` from the start of the publisher physical tensor,
    ``dst_offset`` from the start of the destination receive buffer. Pitches are 0 when
    ``num_rows == 1``; rows never overlap.
    """

    src_rank: int
    src_tensor: str
    src_offset: int
    dst_offset: int
    row_nbytes: int
    num_rows: int = 1
    src_pitch: int = 0
    dst_pitch: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes this run moves."""
        return self.row_nbytes * self.num_rows


@dataclass(frozen=True, slots=True)
class StagedPull:
    """Fallback when a tensor would need more runs than the cap: pull a whole source physical tensor
    contiguously into scratch, then slice locally.

    ``src_nbytes`` bytes go to ``scratch_offset`` of this destination tensor's scratch space; there
    they form a C-contiguous tensor of ``src_local_shape`` in the source dtype. Each entry of
    ``local_copies`` is ``(src_box, dst_box)``: ``(start, stop)`` element bounds per dimension in
    that scratch tensor and in the receive buffer (shape ``dst_shape``, source dtype), each seen
    with leading 1s up to the box's number of dimensions (``warmlink._geometry.pad_shape``).

    For a transposed destination part (Note [Transposed parts] in ``refit.manifest``): ``runs``,
    when not empty, replace the one copy of the whole source tensor: they gather one box of it,
    ``Run.dst_offset`` counting from ``scratch_offset``, into the C-contiguous ``src_local_shape``
    (``src_nbytes`` in all). ``dst_perm`` is the part's ``perm``: each ``dst_box`` is then in the
    part's box order, the receive buffer seen as ``recv.permute(argsort(dst_perm))``.
    """

    src_rank: int
    src_tensor: str
    src_nbytes: int
    scratch_offset: int
    local_copies: tuple[tuple[Box, Box], ...]
    src_local_shape: tuple[int, ...]
    runs: tuple[Run, ...] = ()
    dst_perm: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """How one destination physical tensor is filled: direct runs plus staged pulls.

    The receive buffer is C-contiguous, shape ``dst_shape``, dtype ``src_dtype``; a cast to
    ``dst_dtype`` happens later (``needs_cast``). ``scratch_nbytes`` is the scratch space the staged
    pulls need (0 without any). ``padded``: the destination has padding, which nothing writes (the
    receiver keeps it zero).
    """

    dst: str
    dst_shape: tuple[int, ...]
    src_dtype: str
    dst_dtype: str
    runs: tuple[Run, ...]
    staged: tuple[StagedPull, ...]
    scratch_nbytes: int
    padded: bool = False

    @property
    def needs_cast(self) -> bool:
        """Whether the bytes arrive in another dtype than the destination's."""
        return self.src_dtype != self.dst_dtype

    @property
    def recv_nbytes(self) -> int:
        """Size of the receive buffer in bytes: ``numel(dst_shape) * itemsize(src_dtype)``."""
        n = 1
        for d in self.dst_shape:
            n *= d
        return n * dtype_size(self.src_dtype)

    @property
    def link_nbytes(self) -> int:
        """Bytes this tensor moves over the link (runs plus whole staged source tensors)."""
        return sum(r.nbytes for r in self.runs) + sum(s.src_nbytes for s in self.staged)


@dataclass(frozen=True, slots=True)
class Plan:
    """A whole refit plan: one ``TensorPlan`` per target, in target order, and its layout signature."""

    tensors: tuple[TensorPlan, ...]
    signature: str

    @property
    def num_runs(self) -> int:
        return sum(len(t.runs) for t in self.tensors)

    @property
    def num_staged(self) -> int:
        return sum(len(t.staged) for t in self.tensors)

    @property
    def link_nbytes(self) -> int:
        """Bytes moved over the link, runs plus staged pulls."""
        return sum(t.link_nbytes for t in self.tensors)

    @property
    def recv_nbytes(self) -> int:
        """Total bytes of all receive buffers."""
        return sum(t.recv_nbytes for t in self.tensors)

    @property
    def scratch_nbytes(self) -> int:
        """Total scratch bytes over all tensors (tensors processed one at a time need only the max)."""
        return sum(t.scratch_nbytes for t in self.tensors)


# -- validation ------------------------------------------------------------------------------------
def _check_inputs(
    sources: Mapping[int, Sequence[TensorLayout]],
    targets: Sequence[TensorLayout],
    max_runs_per_tensor: int,
    name_map: Mapping[str, str] | None,
) -> None:
    if isinstance(max_runs_per_tensor, bool) or not isinstance(max_runs_per_tensor, int) or max_runs_per_tensor < 1:
        raise ConfigError(f"build_plan: max_runs_per_tensor={max_runs_per_tensor!r} invalid; expected an int >= 1")
    if not isinstance(sources, Mapping) or not sources:
        raise LayoutError(f"build_plan: sources={sources!r} invalid; expected a non-empty mapping rank -> layouts")
    for rank, layouts in sources.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise LayoutError(f"build_plan: rank={rank!r} out of range; expected an int >= 0")
        _check_layouts(layouts, f"sources[{rank}]")
    _check_layouts(targets, "targets")
    if name_map is not None:
        if not isinstance(name_map, Mapping):
            raise LayoutError(f"build_plan: name_map={name_map!r} invalid; expected a mapping str -> str")
        for k, v in name_map.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise LayoutError(f"build_plan: name_map[{k!r}]={v!r} invalid; expected str -> str")


def _check_layouts(layouts: Sequence[TensorLayout], where: str) -> None:
    if isinstance(layouts, (str, bytes)) or not isinstance(layouts, Sequence):
        raise LayoutError(f"build_plan: {where}={layouts!r} invalid; expected a sequence of TensorLayout")
    seen: set[str] = set()
    for t in layouts:
        if not isinstance(t, TensorLayout):
            raise LayoutError(f"build_plan: {where} item={t!r} invalid; expected a TensorLayout")
        if t.name in seen:
            raise LayoutError(f"build_plan: {where} name={t.name!r} duplicate; expected unique tensor names")
        seen.add(t.name)


# -- signature -------------------------------------------------------------------------------------
def layout_signature(
    sources: Mapping[int, Sequence[TensorLayout]],
    targets: Sequence[TensorLayout],
    *,
    max_runs_per_tensor: int = 64,
    name_map: Mapping[str, str] | None = None,
) -> str:
    """Stable hex SHA-256 of everything a plan depends on; the key plans and buffers are cached by.

    Covers every source rank's layouts (ranks sorted, tensors sorted by name), the targets in
    their given order (the plan lists tensors in that order), ``max_runs_per_tensor`` and
    ``name_map``. Identical inputs give identical signatures in every process.

    Raises:
        LayoutError, ConfigError: as ``build_plan`` for malformed inputs.
    """
    _check_inputs(sources, targets, max_runs_per_tensor, name_map)
    # The repr of nested tuples of str and int is exact and the same in every process (no hash
    # order enters it), and costs far less than JSON for tens of thousands of layouts.
    canon = (
        _SIGNATURE_VERSION,
        tuple((r, tuple(_canon(t) for t in sorted(sources[r], key=lambda t: t.name))) for r in sorted(sources)),
        tuple(_canon(t) for t in targets),
        max_runs_per_tensor,
        tuple(sorted((name_map or {}).items())),
    )
    return hashlib.sha256(repr(canon).encode()).hexdigest()


def _canon(t: TensorLayout) -> tuple:
    canon = t.name, t.dtype, t.shape, tuple((p.logical, p.shard.global_shape, p.shard.bounds, p.offset) for p in t.parts)
    if any(p.replicated for p in t.parts):  # what a plan accepts (Note [Replica choice]); flags leave == out
        canon += (("replicated", tuple(p.replicated for p in t.parts)),)
    return canon + (tuple(p.perm for p in t.parts),) if t.transposed else canon


# -- planning --------------------------------------------------------------------------------------
def _tensor_plan(
    ti: int,
    dst: TensorLayout,
    index: dict[str, _boxes.SourceLogical],
    src_layouts: dict[tuple[int, str], TensorLayout],
    src_shapes: dict[tuple[int, str], tuple[int, ...]],
    name_map: Mapping[str, str],
    cap: int,
) -> TensorPlan:
    """The ``ti``-th target's plan: cover, build and coalesce runs, then stage past ``cap`` (Note [Run cap])."""
    if dst.transposed:
        return _transposed_plan(ti, dst, index, src_layouts, src_shapes, name_map, cap)
    src_dtype, by_src = _boxes.cover(ti, dst, index, name_map)
    itemsize = dtype_size(src_dtype)
    dst_shape = dst.local_shape
    covered = sum(_boxes.box_numel(b) for pairs in by_src.values() for _, b in pairs)
    assert covered == dst.covered_numel, f"plan covers {covered} of {dst.covered_numel} elements of {dst.name!r}"

    runs: dict[tuple[int, str], list[_boxes.RawRun]] = {}
    counts: dict[tuple[int, str], int] = {}
    for key, pairs in by_src.items():
        src_shape = src_shapes[key]
        raw = sum(_boxes.count_runs(s, pad_shape(src_shape, len(s)), d, pad_shape(dst_shape, len(d))) for s, d in pairs)
        if raw > cap:  # See Note [Run cap]: staged whatever else happens
            counts[key] = raw
            continue
        out: list[_boxes.RawRun] = []
        raw_runs = (rr for s, d in pairs
                    for rr in _boxes.box_runs(s, pad_shape(src_shape, len(s)), d, pad_shape(dst_shape, len(d)), itemsize))
        for r in sorted(raw_runs):
            merged = _boxes.merge_runs(out[-1], r) if out else None
            if merged is None:
                out.append(r)
            else:
                out[-1] = merged
        runs[key], counts[key] = out, len(out)

    staged_keys: list[tuple[int, str]] = []
    total = sum(counts.values())
    for key in sorted(counts, key=lambda k: (-counts[k], k)):
        if total <= cap or counts[key] <= 1:
            break
        staged_keys.append(key)
        total -= counts[key] - 1

    staged, at = [], 0
    for key in sorted(staged_keys):
        src = src_layouts[key]
        at = -(-at // SCRATCH_ALIGN_BYTES) * SCRATCH_ALIGN_BYTES
        staged.append(StagedPull(key[0], key[1], src.nbytes, at, tuple(by_src[key]), src.local_shape))
        at += src.nbytes
    run_objs = tuple(
        Run(key[0], key[1], *r) for key in sorted(runs) if key not in staged_keys for r in runs[key]
    )
    return TensorPlan(dst.name, dst_shape, src_dtype, dst.dtype, run_objs, tuple(staged), at, dst.is_padded)


def _transposed_plan(
    ti: int,
    dst: TensorLayout,
    index: dict[str, _boxes.SourceLogical],
    src_layouts: dict[tuple[int, str], TensorLayout],
    src_shapes: dict[tuple[int, str], tuple[int, ...]],
    name_map: Mapping[str, str],
    cap: int,
) -> TensorPlan:
    """A target with transposed parts (Note [Transposed parts] in ``refit.manifest``): its other
    parts planned as any target's; each source box a transposed part reads is staged, compactly by
    its own runs when at most ``cap`` of them fetch it, else as the whole source tensor, and the
    translate step permutes it into place (``StagedPull.dst_perm``)."""
    plain = tuple(p for p in dst.parts if p.perm is None)
    runs: tuple[Run, ...] = ()
    staged: list[StagedPull] = []
    at, src_dtype = 0, None
    if plain:  # the transposed parts' places are padding to this plan, written by the staged pulls
        sub = _tensor_plan(ti, TensorLayout(dst.name, dst.dtype, plain, dst.shape), index, src_layouts, src_shapes,
                           name_map, cap)
        runs, staged, at, src_dtype = sub.runs, list(sub.staged), sub.scratch_nbytes, sub.src_dtype
    for part in dst.parts:
        if part.perm is None:
            continue
        # The part seen in its box's own dimension order: receive buffer permuted by argsort(perm).
        inv = sorted(range(len(part.perm)), key=part.perm.__getitem__)
        view = TensorLayout(dst.name, dst.dtype, (Part(part.logical, part.shard, tuple(part.offset[d] for d in inv)),),
                            tuple(dst.shape[d] for d in inv))
        dtype, by_src = _boxes.cover(ti, view, index, name_map)
        if src_dtype is not None and dtype != src_dtype:
            raise LayoutError(f"build_plan: dtype={dtype!r} of source logical={part.logical!r} differs from {src_dtype!r} of "
                              f"another part (dst tensor={dst.name!r}); expected one source dtype per destination tensor")
        src_dtype, itemsize = dtype, dtype_size(dtype)
        for key in sorted(by_src):
            src_shape, pairs = src_shapes[key], by_src[key]
            compact = [((s, tuple((0, b - a) for a, b in s)), d) for s, d in pairs]
            counts = sum(_boxes.count_runs(s, pad_shape(src_shape, len(s)), z, _boxes.box_shape(s)) for (s, z), _ in compact)
            if counts > cap:  # See Note [Run cap]: one copy of the whole source tensor instead
                at = -(-at // SCRATCH_ALIGN_BYTES) * SCRATCH_ALIGN_BYTES
                src = src_layouts[key]
                staged.append(StagedPull(key[0], key[1], src.nbytes, at, tuple(pairs), src.local_shape, (), part.perm))
                at += src.nbytes
                continue
            for (s, z), d in compact:
                at = -(-at // SCRATCH_ALIGN_BYTES) * SCRATCH_ALIGN_BYTES
                shape = _boxes.box_shape(s)
                out: list[_boxes.RawRun] = []
                for r in sorted(_boxes.box_runs(s, pad_shape(src_shape, len(s)), z, shape, itemsize)):
                    merged = _boxes.merge_runs(out[-1], r) if out else None
                    if merged is None:
                        out.append(r)
                    else:
                        out[-1] = merged
                nbytes = _boxes.box_numel(s) * itemsize
                staged.append(StagedPull(key[0], key[1], nbytes, at, ((z, d),), shape,
                                         tuple(Run(key[0], key[1], *r) for r in out), part.perm))
                at += nbytes
    assert src_dtype is not None, "TensorLayout guarantees at least one part"
    return TensorPlan(dst.name, dst.local_shape, src_dtype, dst.dtype, runs, tuple(staged), at, dst.is_padded)


def build_plan(
    sources: Mapping[int, Sequence[TensorLayout]],
    targets: Sequence[TensorLayout],
    *,
    max_runs_per_tensor: int = 64,
    name_map: Mapping[str, str] | None = None,
    _signature: str | None = None,
) -> Plan:
    """Plan which publisher bytes fill each receiver tensor.

    Args:
        sources: publisher rank (int >= 0) -> the physical tensors that rank exports. Tensor names
            are unique per rank; one logical tensor has one global shape and one dtype everywhere.
        targets: the receiver's physical tensors, unique names; their dtype may differ from the
            source dtype (the plan moves source-dtype bytes and reports ``needs_cast``).
        max_runs_per_tensor: most link copies (runs plus staged pulls) per target tensor, >= 1;
            see Note [Run cap].
        name_map: destination logical name -> publisher logical name; identity where absent.

    Returns:
        A ``Plan`` (immutable, owned by the caller) with one ``TensorPlan`` per target, in order.
        Every destination element is written exactly once; replicated sources are chosen as in
        Note [Replica choice]. Runs are sorted by (src_rank, src_tensor, src_offset).

    Raises:
        LayoutError: a logical tensor no publisher holds, a destination box no publisher covers,
            global shapes or source dtypes that disagree, several source dtypes in one target,
            a bad rank or duplicate tensor names, two source parts holding one element where
            not both are replicas (Note [Replica choice]), a cast to or from FP8, or FP8 values
            declared without their scales (Note [FP8 versions] in ``refit._fp8_layout``).
        ConfigError: ``max_runs_per_tensor`` is not an int >= 1.

    Collective? No. Blocking? Host only, no device work. Warm path? No: this is the plan step; cache
    the result by ``Plan.signature`` (``layout_signature``).
    """
    sig = _signature or layout_signature(sources, targets, max_runs_per_tensor=max_runs_per_tensor, name_map=name_map)
    index = _boxes.index_sources(sources)
    _check_replicas(index)
    nm = dict(name_map or {})
    check_scales(index, targets, nm)  # See Note [FP8 versions] in refit._fp8_layout
    src_layouts = {(r, t.name): t for r, ts in sources.items() for t in ts}
    src_shapes: dict[tuple[int, str], tuple[int, ...]] = {}
    sole = _sole_holders(index)
    plans = []
    for ti, t in enumerate(targets):
        plan = _identical_plan(t, sole, src_layouts, nm)
        if plan is None:
            src_shapes = src_shapes or {k: t.local_shape for k, t in src_layouts.items()}
            plan = _tensor_plan(ti, t, index, src_layouts, src_shapes, nm, max_runs_per_tensor)
        plans.append(plan)
    return Plan(tuple(plans), sig)


def _sole_holders(index: dict[str, _boxes.SourceLogical]) -> dict[tuple[str, Box], tuple[int, str]]:
    """``(logical, box) -> (rank, tensor)`` for every box that one source part holds and no other
    source part holds or overlaps (a tensor-parallel shard; not a replica)."""
    out: dict[tuple[str, Box], tuple[int, str]] = {}
    for logical, ent in index.items():
        shared = _overlapping(list(ent.holders)) if len(ent.holders) > 1 else ()
        for box, hs in ent.holders.items():
            if len(hs) == 1 and box not in shared:
                out[(logical, box)] = hs[0][:2]
    return out


def _check_replicas(index: dict[str, _boxes.SourceLogical]) -> None:
    """Refuse any element held by two source parts unless both are replicas: marked replicated or
    the whole tensor (Note [Replica choice])."""
    for logical, ent in index.items():
        if not ent.exclusive:
            continue  # every holder a replica
        for box, hs in ent.holders.items():
            if len(hs) > 1 and not ent.exclusive.isdisjoint(hs):
                _refuse_overlap(logical, ent, (box, hs), (box, hs))
        if len(ent.holders) > 1:
            for a, b in _overlap_pairs(list(ent.holders)):
                if not (ent.exclusive.isdisjoint(ent.holders[a]) and ent.exclusive.isdisjoint(ent.holders[b])):
                    _refuse_overlap(logical, ent, (a, ent.holders[a]), (b, ent.holders[b]))


def _refuse_overlap(logical: str, ent: _boxes.SourceLogical, a: tuple[Box, list], b: tuple[Box, list]) -> NoReturn:
    """The LayoutError for two holders of one element, at least one of them not a replica."""
    boxes = (a,) if a[0] == b[0] else (a, b)
    held = [(box, h) for box, hs in boxes for h in hs]
    box1, h1 = next((box, h) for box, h in held if h in ent.exclusive)
    # the other holder: of the same box, or of the other box when two distinct boxes overlap
    box2, h2 = next((box, h) for box, h in held if h != h1 and (len(boxes) == 1 or box != box1))
    (r1, t1, _), (r2, t2, _) = h1, h2
    if box1 == box2:
        where = f"box={box1!r} is held by rank={r1} tensor={t1!r} and by rank={r2} tensor={t2!r}"
    else:
        where = f"box={box1!r} of rank={r1} tensor={t1!r} overlaps box={box2!r} of rank={r2} tensor={t2!r}"
    which = "neither part is" if h2 in ent.exclusive else f"the part of rank={r1} tensor={t1!r} is not"
    raise LayoutError(
        f"build_plan: logical={logical!r} {where} (global coordinates), and {which} marked replicated; expected "
        "each element of a sharded tensor on one publisher, or every part holding it marked replicated "
        "(Part(..., replicated=True); families.layouts and DTensor placements mark what the framework replicates). "
        "Two trainer ranks built with the same rank= publish the same shard with different bytes "
        "(Note [Replica choice])"
    )


def _overlap_pairs(boxes: list[Box]) -> Iterator[tuple[Box, Box]]:
    """The pairs of ``boxes`` (distinct, non-empty, sorted) that intersect: a sweep along dimension 0."""
    active: list[Box] = []
    for box in boxes:
        if not box:  # 0-d: distinct boxes means this is the only one
            continue
        active = [b for b in active if b[0][1] > box[0][0]]
        for b in active:
            if _boxes.intersect(b, box) is not None:
                yield b, box
        active.append(box)


def _overlapping(boxes: list[Box]) -> set[Box]:
    """The boxes of ``boxes`` (distinct, non-empty, sorted) that intersect another one: a sweep
    along dimension 0."""
    out: set[Box] = set()
    active: list[Box] = []
    for box in boxes:
        if not box:  # 0-d: distinct boxes means this is the only one
            continue
        active = [b for b in active if b[0][1] > box[0][0]]
        for b in active:
            if _boxes.intersect(b, box) is not None:
                out.update((b, box))
        active.append(box)
    return out


def _identical_plan(dst: TensorLayout, sole: dict, src_layouts: dict, name_map: Mapping[str, str]) -> TensorPlan | None:
    """One whole-tensor run when one unpadded source tensor has exactly ``dst``'s layout and is
    the sole holder of every box of it.

    The common matched-TP case; skipping box intersection keeps 290-tensor plans near 2 ms and
    costs a few lookups per tensor at 40,000. The general path would copy the same bytes from the
    same source (Note [Replica choice] does not apply: no other part holds them).
    """
    if name_map and any(name_map.get(p.logical, p.logical) != p.logical for p in dst.parts):
        return None
    first = next((p for p in dst.parts if p.shard.numel), None)
    key = sole.get((first.logical, first.shard.bounds)) if first is not None else None
    if key is None:
        return None
    src = src_layouts[key]
    if src.dtype != dst.dtype or src.shape != dst.shape or src.parts != dst.parts or src.is_padded:
        return None
    if len(src.parts) > 1 and any(p.shard.numel and sole.get((p.logical, p.shard.bounds)) != key for p in src.parts):
        return None
    runs = (Run(key[0], src.name, 0, 0, dst.nbytes),) if dst.nbytes else ()
    return TensorPlan(dst.name, dst.local_shape, src.dtype, dst.dtype, runs, (), 0)


# -- common fused layouts --------------------------------------------------------------------------
def _positive(func: str, **values: int) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LayoutError(f"{func}: {k}={v!r} invalid; expected an int >= 1")


def _tp_shard(func: str, shape: tuple[int, int], tp: int, rank: int) -> Shard:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise LayoutError(f"{func}: rank={rank!r} out of range; expected 0 <= rank < tp={tp}")
    return Shard(shape) if tp == 1 else Shard.split(shape, 0, tp, rank)


def qkv_layout(
    name: str, dtype: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int, hidden: int, tp: int,
    rank: int, logical: tuple[str, str, str] = ("q", "k", "v"),
) -> TensorLayout:
    """Fused ``[q; k; v]`` projection (along dim 0) held by tensor-parallel ``rank`` of ``tp``.

    Logical shapes are ``q: [num_q_heads * head_dim, hidden]`` and ``k, v: [num_kv_heads *
    head_dim, hidden]`` (elements). q is split ``tp`` ways by heads. k/v are split ``tp`` ways when
    ``num_kv_heads >= tp``; otherwise each KV head is replicated on ``tp // num_kv_heads`` ranks and
    ``rank`` holds head ``rank * num_kv_heads // tp`` (Megatron / vLLM GQA layout), its k and v
    parts marked replicated (Note [Replicated parts] in ``refit.manifest``).

    Raises:
        LayoutError: non-positive sizes, ``rank`` outside ``[0, tp)``, ``num_q_heads % tp != 0``,
            ``num_kv_heads % tp != 0`` (when ``num_kv_heads >= tp``) or ``tp % num_kv_heads != 0``.
    """
    f = f"qkv_layout {name!r}"
    _positive(f, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, hidden=hidden, tp=tp)
    if num_q_heads % tp:
        raise LayoutError(f"{f}: num_q_heads={num_q_heads} not divisible by tp={tp}; expected whole heads per rank")
    q = _tp_shard(f, (num_q_heads * head_dim, hidden), tp, rank)
    kv_shape = (num_kv_heads * head_dim, hidden)
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise LayoutError(
                f"{f}: num_kv_heads={num_kv_heads} not divisible by tp={tp}; expected whole KV heads per rank"
            )
        kv = _tp_shard(f, kv_shape, tp, rank)
    else:
        if tp % num_kv_heads:
            raise LayoutError(
                f"{f}: tp={tp} not a multiple of num_kv_heads={num_kv_heads}; expected each KV head replicated "
                "on the same number of ranks"
            )
        kv = Shard(kv_shape) if num_kv_heads == 1 else Shard.split(kv_shape, 0, num_kv_heads, rank * num_kv_heads // tp)
    replicas = num_kv_heads < tp  # each KV head on tp / num_kv_heads ranks
    return TensorLayout.fused(name, dtype, [(logical[0], q), (logical[1], kv, replicas), (logical[2], kv, replicas)])


def gate_up_layout(
    name: str, dtype: str, *, intermediate: int, hidden: int, tp: int, rank: int,
    logical: tuple[str, str] = ("gate", "up"),
) -> TensorLayout:
    """Fused ``[gate; up]`` MLP projection (along dim 0) held by tensor-parallel ``rank`` of ``tp``.

    Each logical is ``[intermediate, hidden]`` (elements), split ``tp`` ways along dim 0; an uneven
    split follows Note [Uneven shards] in ``refit.manifest``.

    Raises:
        LayoutError: non-positive sizes, ``rank`` outside ``[0, tp)`` or ``intermediate < tp``.
    """
    f = f"gate_up_layout {name!r}"
    _positive(f, intermediate=intermediate, hidden=hidden, tp=tp)
    shard = _tp_shard(f, (intermediate, hidden), tp, rank)
    return TensorLayout.fused(name, dtype, [(logical[0], shard), (logical[1], shard)])
