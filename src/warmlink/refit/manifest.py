"""How tensors are laid out on each side of a refit: boxes of logical tensors placed in physical ones.

A *logical* tensor is one weight as the model defines it, in global coordinates (``q_proj`` of
layer 3, shape ``[num_heads * head_dim, hidden]``). A *physical* tensor is what one rank holds in
memory. It holds *parts*: each part is an N-D box of one logical tensor (``Shard``: explicit
``[start, stop)`` bounds per dimension) placed at an offset in the physical tensor (``Part``).

That one model says what the frameworks do, exactly:

* ``torch.tensor_split`` and ``torch.chunk`` shards, empty shards, 2-D meshes: a box each
  (``Shard.split``, ``Shard.chunk``, ``Shard(global_shape, bounds)``).
* fused tensors (vLLM's ``[q; k; v]``, ``[gate; up]``): parts of several logical tensors placed
  one after another along a dimension (``TensorLayout.fused``).
* interleaved tensors (Megatron's QKV, ``[q_g; k_g; v_g]`` per query group): several boxes of one
  logical tensor in one physical tensor.
* padded tensors (vLLM's and Megatron's vocabularies): a physical ``shape`` larger than its parts;
  uncovered elements are padding, never sent and never compared. A receiver's padding holds zeros
  after every install.
* transposed tensors (vLLM's GPT-OSS experts): a part whose box is stored with its dimensions
  permuted (``Part.perm``, Note [Transposed parts]); receivers only.

Rules are in Note [Layout rules] (``warmlink._geometry``), checked here and again on every manifest
read from the store. Plans (``warmlink.refit.plan``) intersect the boxes. Everything here is pure
data with validation; nothing touches memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Sequence

from warmlink._dtypes import DTYPE_SIZES, dtype_size
from warmlink._geometry import Box, box_numel, box_shape, layout_problem
from warmlink.errors import LayoutError

__all__ = ["Shard", "Part", "TensorLayout", "split_bounds", "chunk_bounds"]


class _cached:
    """``functools.cached_property`` without its lock, which Python 3.11 takes on every first
    access (seconds over a 40,000-tensor manifest): layouts are immutable, so two threads that
    compute one value at once compute the same value."""

    def __init__(self, func) -> None:
        self.func, self.name, self.__doc__ = func, func.__name__, func.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)  # read from the instance from now on
        return value


def _check_split(func: str, size: int, num: int, idx: int) -> None:
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise LayoutError(f"{func}: num={num!r} invalid; expected an int >= 1")
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < num:
        raise LayoutError(f"{func}: idx={idx!r} out of range; expected 0 <= idx < {num}")


def split_bounds(size: int, num_shards: int, shard_idx: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``shard_idx`` of ``torch.tensor_split(range(size), num_shards)``.

    # Note [Uneven shards]
    ``tensor_split`` gives the first ``size % num_shards`` shards ``size // num_shards + 1`` rows
    and the rest ``size // num_shards`` (vLLM and Megatron split evenly and refuse the rest).
    ``torch.chunk`` (``chunk_bounds``), which DTensor's ``Shard`` and so FSDP2 and
    ``parallelize_module`` use, gives every chunk ``ceil(size / num)`` rows until the rows run out,
    so trailing chunks may be short or empty. The two agree when ``num`` divides ``size``.
    """
    _check_split("split_bounds", size, num_shards, shard_idx)
    base, extra = divmod(size, num_shards)
    start = shard_idx * base + min(shard_idx, extra)
    return start, start + base + (1 if shard_idx < extra else 0)


def chunk_bounds(size: int, num_chunks: int, chunk_idx: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``chunk_idx`` of ``torch.chunk(range(size), num_chunks)``, counting
    the chunks ``torch.chunk`` leaves out as empty. See Note [Uneven shards]."""
    _check_split("chunk_bounds", size, num_chunks, chunk_idx)
    step = -(-size // num_chunks)
    start = min(chunk_idx * step, size)
    return start, min(start + step, size)


def _as_shape(value, func: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in value)
    except TypeError:
        raise LayoutError(f"{func}: shape={value!r} invalid; expected a sequence of ints") from None
    if any(d < 0 for d in shape):
        raise LayoutError(f"{func}: shape={shape} has a negative dimension")
    return shape


@dataclass(frozen=True)
class Shard:
    """The box of a logical tensor one part holds, in the logical tensor's global coordinates.

    Args:
        global_shape: shape of the whole logical tensor, in elements.
        bounds: ``(start, stop)`` per dimension, half-open; ``None`` (default): the whole tensor.
            A box may be empty (a rank holding none of it). Several ranks may hold the same box
            (replicated norms, grouped-query KV heads replicated when TP > num_kv_heads) where
            their parts say so (Note [Replicated parts]).

    Raises:
        LayoutError: bounds of another rank than ``global_shape`` or outside it.
    """

    global_shape: tuple[int, ...]
    bounds: Box | None = None

    def __post_init__(self) -> None:
        shape = _as_shape(self.global_shape, "Shard")
        object.__setattr__(self, "global_shape", shape)
        if self.bounds is None:
            object.__setattr__(self, "bounds", tuple((0, d) for d in shape))
            return
        try:
            bounds = tuple((int(a), int(b)) for a, b in self.bounds)
        except (TypeError, ValueError):
            raise LayoutError(f"Shard: bounds={self.bounds!r} invalid; expected (start, stop) per dimension") from None
        if len(bounds) != len(shape):
            raise LayoutError(f"Shard: bounds={bounds} has {len(bounds)} dims; expected {len(shape)} as global_shape={shape}")
        for d, ((start, stop), size) in enumerate(zip(bounds, shape)):
            if not 0 <= start <= stop <= size:
                raise LayoutError(
                    f"Shard: bounds[{d}]=({start}, {stop}) out of range for global_shape={shape}; "
                    f"expected 0 <= start <= stop <= {size}"
                )
        object.__setattr__(self, "bounds", bounds)

    @classmethod
    def split(cls, global_shape: Sequence[int], dim: int, num_shards: int, shard_idx: int) -> "Shard":
        """Shard ``shard_idx`` of ``torch.tensor_split`` along ``dim`` (Note [Uneven shards])."""
        return cls._along(global_shape, dim, split_bounds, num_shards, shard_idx, "Shard.split")

    @classmethod
    def chunk(cls, global_shape: Sequence[int], dim: int, num_chunks: int, chunk_idx: int) -> "Shard":
        """Chunk ``chunk_idx`` of ``torch.chunk`` along ``dim``, possibly empty (Note [Uneven shards])."""
        return cls._along(global_shape, dim, chunk_bounds, num_chunks, chunk_idx, "Shard.chunk")

    @classmethod
    def _along(cls, global_shape, dim, rule, num, idx, func) -> "Shard":
        shape = _as_shape(global_shape, func)
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(shape):
            raise LayoutError(f"{func}: dim={dim!r} out of range for global_shape={shape}; expected 0 <= dim < {len(shape)}")
        bounds = [(0, d) for d in shape]
        bounds[dim] = rule(shape[dim], num, idx)
        return cls(shape, tuple(bounds))

    def narrow(self, dim: int, start: int, stop: int) -> "Shard":
        """This box with dimension ``dim`` cut to ``[start, stop)`` (global coordinates, clipped to the box)."""
        bounds = list(self.bounds)
        lo, hi = bounds[dim]
        a = min(max(start, lo), hi)
        bounds[dim] = (a, max(a, min(stop, hi)))
        return Shard(self.global_shape, tuple(bounds))

    def box(self) -> Box:
        """``[start, stop)`` per dimension, in global coordinates."""
        return self.bounds

    @_cached
    def local_shape(self) -> tuple[int, ...]:
        """Extent of the box per dimension (cached: layouts are immutable)."""
        return box_shape(self.bounds)

    @property
    def numel(self) -> int:
        return box_numel(self.bounds)


@dataclass(frozen=True)
class Part:
    """A box of logical tensor ``logical`` placed at ``offset`` (elements, per physical dimension)
    in a physical tensor. ``offset=None`` lets ``TensorLayout`` place a lone part at the origin.
    ``perm``: the box is stored transposed, physical dimension ``d`` holding box dimension
    ``perm[d]`` (Note [Transposed parts]); ``None`` (and the identity, which ``TensorLayout``
    normalizes to ``None``): not transposed. ``replicated`` (keyword only): the framework keeps
    this box on several ranks, so other publishers may hold it too (Note [Replicated parts])."""

    logical: str
    shard: Shard
    offset: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None
    # A claim about other ranks, not about this tensor's bytes: out of ==/hash (Note [Replicated parts]).
    replicated: bool = field(default=False, compare=False, kw_only=True)

    def local_box(self) -> Box:
        """Where the box lies in the physical tensor, per physical dimension (squeezed leading
        dimensions dropped): ``physical[slices(local_box)]`` holds ``logical[slices(shard.bounds)]``
        reshaped to it (permuted by ``perm`` first, for a transposed part)."""
        ndim = len(self.offset or ())
        extents = self.shard.local_shape[len(self.shard.local_shape) - ndim:] if ndim else ()
        if self.perm is not None:
            extents = tuple(extents[p] for p in self.perm)
        return tuple((o, o + e) for o, e in zip(self.offset or (), extents))


# Note [Transposed parts]
# A part with ``perm`` holds its box transposed: ``physical[slices(local_box)]`` equals
# ``logical[slices(bounds)]``, its squeezed leading dimensions dropped, then ``.permute(perm)``.
# vLLM's GPT-OSS experts are the case (Note [vLLM GPT-OSS] in ``families.vllm``): ``w13_weight``
# ``[E, 2I/tp, H]`` holds columns of transformers' ``gate_up_proj [E, H, 2I]`` with perm (0, 2, 1).
# A box at an offset says where elements go, never in which order; ``perm`` is the one addition.
#
# No byte run copies a transpose, so a plan pulls what a transposed destination part needs into
# scratch, contiguously (the source box itself when a few runs fetch it, else the whole source
# tensor, Note [Run cap]), and the translate step permutes it into place (``StagedPull.dst_perm``,
# ``translate.unstage``). Transposed parts are receiver-only: ``Publisher.add`` / ``add_module``,
# ``to_json`` and ``build_plan``'s sources refuse them. The only framework that holds one is an
# inference engine, which publishes nothing (a relay republishing an engine's tensors would
# republish them in a source layout); so manifests carry no perm (readable by
# every receiver), and every source stays a strided layout that byte runs read directly.

# Note [Replicated parts]
# A part marked ``replicated`` says the framework keeps its box on several ranks: GQA KV heads
# when TP > num_kv_heads (vLLM's ``num_kv_head_replicas``), every dense tensor on each
# data-parallel replica (a DTensor's ``Replicate()`` or a mesh smaller than its root mesh, as in
# HSDP or a TP sub-mesh of a 2-D mesh; vLLM and hf ranks with ep > tp; Megatron's ``dp`` and
# expert-data-parallel ranks). A part holding its whole logical tensor counts as replicated
# without the flag: whole tensors on every rank (norms, routers, DDP) are what frameworks do.
# A plan reads a box held by several publishers from any one of them (Note [Replica choice] in
# ``refit.plan``), so it accepts two holders of one element only when both parts say replicated;
# any other overlap is a ``LayoutError`` at plan time, before any byte moves. Two trainer ranks
# built with the same ``rank=`` publish the same boxes of different bytes, and only the layouts
# can tell that apart from replicas.
#
# The flag is a claim about other ranks, not about this tensor's bytes, so ``Part`` equality and
# hash leave it out: a layout rebuilt from a live engine's modules, which cannot know how its
# replicas were declared, still equals the family's. What decides what a plan accepts carries it:
# the manifest JSON (``"replicated": true``, omitted when false) and the layout signature that plans
# are cached by (``refit.plan.layout_signature``).


@dataclass(frozen=True)
class TensorLayout:
    """A physical tensor one rank holds: its name, dtype, shape and the parts inside it.

    Args:
        name: the physical tensor's name (unique per rank).
        dtype: wire dtype name (``"bfloat16"``).
        parts: the boxes of logical tensors it holds, each with its offset.
        shape: physical shape in elements; default: the smallest shape holding every part.
            Elements no part covers are padding (See Note [Layout rules] in ``warmlink._geometry``).

    Raises:
        LayoutError: parts that break Note [Layout rules], naming the tensor and the part.
    """

    name: str
    dtype: str
    parts: tuple[Part, ...]
    shape: tuple[int, ...] | None = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"TensorLayout: name={self.name!r} invalid; expected a non-empty string")
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"TensorLayout {self.name!r}: dtype={self.dtype!r} is unknown; expected one of {sorted(DTYPE_SIZES)}")
        parts = tuple(self.parts)
        if not parts:
            raise LayoutError(f"TensorLayout {self.name!r}: parts=() is empty; expected at least one Part")
        for p in parts:
            if not isinstance(p, Part) or not isinstance(p.shard, Shard) or not isinstance(p.logical, str) or not p.logical:
                raise LayoutError(f"TensorLayout {self.name!r}: part={p!r} invalid; expected Part(logical: str, Shard)")
            if type(p.replicated) is not bool:
                raise LayoutError(f"TensorLayout {self.name!r}: part of logical={p.logical!r} has replicated={p.replicated!r}; "
                                  "expected a bool (Note [Replicated parts])")
        unplaced = [p for p in parts if p.offset is None]
        if unplaced and len(parts) > 1:
            raise LayoutError(
                f"TensorLayout {self.name!r}: {len(unplaced)} of {len(parts)} parts have no offset; "
                "expected an offset for each part of a multi-part tensor (or TensorLayout.fused)"
            )
        if unplaced:
            p = parts[0]
            ndim = len(_as_shape(self.shape, f"TensorLayout {self.name!r}")) if self.shape is not None else len(p.shard.global_shape)
            parts = (Part(p.logical, p.shard, (0,) * ndim, _perm(self.name, p.perm, ndim), replicated=p.replicated),)
        else:
            parts = tuple(p if type(p.offset) is tuple and all(type(o) is int for o in p.offset) and p.perm is None
                          else Part(p.logical, p.shard, tuple(int(o) for o in p.offset), _perm(self.name, p.perm, len(p.offset)),
                                    replicated=p.replicated)
                          for p in parts)
        object.__setattr__(self, "parts", parts)
        if self.shape is None:
            ndim = len(parts[0].offset)
            shape = tuple(
                max(p.offset[d] + p.shard.local_shape[len(p.shard.local_shape) - ndim + (d if p.perm is None else p.perm[d])]
                    for p in parts)
                for d in range(ndim)
            ) if all(len(p.offset) == ndim and len(p.shard.global_shape) >= ndim for p in parts) else None
            if shape is None:
                raise LayoutError(f"TensorLayout {self.name!r}: parts place boxes in different numbers of dims; "
                                  "expected one offset length (pass shape=)")
        else:
            shape = _as_shape(self.shape, f"TensorLayout {self.name!r}")
        object.__setattr__(self, "shape", shape)
        problem = layout_problem(shape, [(p.logical, p.shard.global_shape, p.shard.bounds, p.offset) if p.perm is None
                                         else (p.logical, p.shard.global_shape, p.shard.bounds, p.offset, p.perm)
                                         for p in parts])
        if problem is not None:
            raise LayoutError(f"TensorLayout {self.name!r}: {problem}")
        object.__setattr__(self, "_hash", hash((self.name, self.dtype, parts, shape)))

    def __hash__(self) -> int:
        # Layouts key plan and signature caches: hashed once, not by walking every part per lookup.
        return self._hash

    def __getstate__(self) -> dict:
        # The cached hash is per process (str hashes are salted): never pickled to another one.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_hash", hash((self.name, self.dtype, self.parts, self.shape)))

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def plain(
        cls,
        name: str,
        dtype: str,
        global_shape: Sequence[int],
        split_dim: int | None = None,
        num_shards: int = 1,
        shard_idx: int = 0,
        logical: str | None = None,
        *,
        shape: Sequence[int] | None = None,
        replicated: bool = False,
    ) -> "TensorLayout":
        """One box of one logical tensor (named ``logical or name``) at the origin.

        ``split_dim``/``num_shards``/``shard_idx`` cut it as ``torch.tensor_split`` does; ``shape``
        pads the physical tensor past the box (a padded vocabulary shard); ``replicated``: other
        ranks hold this box too (Note [Replicated parts]; a whole tensor needs no flag).

        Raises:
            LayoutError: any bad argument, naming the tensor.
        """
        try:
            args = (cls, name, dtype, tuple(global_shape), split_dim, num_shards, shard_idx, logical,
                    None if shape is None else tuple(shape), replicated)
        except TypeError:
            field_, value = ("shape", shape) if hasattr(global_shape, "__iter__") else ("global_shape", global_shape)
            raise LayoutError(f"TensorLayout.plain {name!r}: {field_}={value!r} invalid; expected a sequence of ints") from None
        try:
            return _plain(*args)
        except TypeError:  # an unhashable argument: build it uncached (and report what is wrong)
            return _plain.__wrapped__(*args)

    @classmethod
    def fused(
        cls,
        name: str,
        dtype: str,
        parts: Sequence[tuple[str, Shard] | tuple[str, Shard, bool]],
        fuse_dim: int = 0,
        *,
        shape: Sequence[int] | None = None,
    ) -> "TensorLayout":
        """Boxes placed one after another along ``fuse_dim`` (vLLM's ``[q; k; v]`` per rank).

        Each item is ``(logical, shard)`` or ``(logical, shard, replicated)`` (Note [Replicated
        parts]: vLLM's k and v when TP > num_kv_heads). The same logical name may appear more than
        once (several boxes of one tensor, as in Megatron's QKV interleaved per query group).

        Raises:
            LayoutError: a malformed item, ``fuse_dim`` out of range, or parts that disagree
                outside ``fuse_dim``, naming the tensor.
        """
        placed, at = [], 0
        for item in parts:
            try:
                logical, shard, *flag = item
            except (TypeError, ValueError):
                flag = [None, None]
            if len(flag) > 1 or not isinstance(shard, Shard):
                raise LayoutError(f"TensorLayout.fused {name!r}: part={item!r} invalid; expected (logical, Shard) or "
                                  "(logical, Shard, replicated)")
            ndim = len(shard.global_shape)
            if isinstance(fuse_dim, bool) or not isinstance(fuse_dim, int) or not 0 <= fuse_dim < ndim:
                raise LayoutError(f"TensorLayout.fused {name!r}: fuse_dim={fuse_dim} out of range for {logical!r} "
                                  f"of global_shape={shard.global_shape}")
            offset = [0] * ndim
            offset[fuse_dim] = at
            placed.append(Part(logical, shard, tuple(offset), replicated=flag[0] if flag else False))
            at += shard.local_shape[fuse_dim]
        if placed:
            others = {tuple(s for d, s in enumerate(p.shard.local_shape) if d != fuse_dim) for p in placed}
            if len(others) > 1:
                raise LayoutError(f"TensorLayout.fused {name!r}: parts disagree outside fuse_dim={fuse_dim} "
                                  f"({[p.shard.local_shape for p in placed]}); only fuse_dim may differ")
        return cls(name, dtype, tuple(placed), None if shape is None else tuple(shape))

    # -- derived ---------------------------------------------------------------------------------
    @property
    def local_shape(self) -> tuple[int, ...]:
        """The physical tensor's shape (``shape``), in elements."""
        return self.shape

    @_cached
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @_cached
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)

    @_cached
    def covered_numel(self) -> int:
        """Elements that parts cover (``numel`` less the padding)."""
        return sum(p.shard.numel for p in self.parts)

    @property
    def is_padded(self) -> bool:
        return self.covered_numel != self.numel

    @_cached
    def transposed(self) -> bool:
        """Whether a part is stored transposed (Note [Transposed parts]): receivers only."""
        return any(p.perm is not None for p in self.parts)

    def with_replicated(self) -> "TensorLayout":
        """This layout with every part marked replicated (Note [Replicated parts]): what a
        data-parallel replica holds, the same boxes as its peers in the other replicas."""
        if all(p.replicated for p in self.parts):
            return self
        return TensorLayout(self.name, self.dtype, tuple(replace(p, replicated=True) for p in self.parts), self.shape)

    def to_json(self) -> dict:
        if self.transposed:
            p = next(p for p in self.parts if p.perm is not None)
            raise LayoutError(f"TensorLayout {self.name!r}: part of logical={p.logical!r} has perm={p.perm}; expected no "
                              "transposed part in a manifest (receivers only, Note [Transposed parts])")
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "parts": [
                {"logical": p.logical, "global_shape": list(p.shard.global_shape),
                 "bounds": [list(b) for b in p.shard.bounds], "offset": list(p.offset),
                 **_REPLICATED_JSON[p.replicated]}  # omitted when false: Note [Replicated parts]
                for p in self.parts
            ],
        }

    @classmethod
    def from_json(cls, obj: dict) -> "TensorLayout":
        """Inverse of ``to_json`` for an object already checked by ``rendezvous.schema``; a part
        without ``replicated`` is not (a manifest from before the flag reads as it did)."""
        try:
            parts = tuple(
                Part(p["logical"], _shard(tuple(p["global_shape"]), tuple(tuple(b) for b in p["bounds"])), tuple(p["offset"]),
                     replicated=p.get("replicated", False))
                for p in obj["parts"]
            )
        except LayoutError as e:
            raise LayoutError(f"TensorLayout {obj.get('name')!r}: {e}") from None
        return cls(obj["name"], obj["dtype"], parts, tuple(obj["shape"]))


_REPLICATED_JSON = {False: {}, True: {"replicated": True}}


def _perm(name: str, perm, ndim: int) -> tuple[int, ...] | None:
    """``perm`` as a tuple of ints, the identity as None (one layout, one value); checked by
    ``layout_problem`` to be a permutation of the physical dimensions."""
    if perm is None:
        return None
    try:
        out = tuple(int(d) for d in perm)
    except (TypeError, ValueError):
        out = None
    if out is None or sorted(out) != list(range(ndim)):
        raise LayoutError(f"TensorLayout {name!r}: perm={perm!r} invalid; expected a permutation of range({ndim}) "
                          "(one entry per physical dimension)")
    return None if out == tuple(range(ndim)) else out


# A manifest of tens of thousands of tensors holds a few dozen distinct boxes: equal ones share
# one validated, immutable Shard.
@lru_cache(maxsize=4096)
def _shard(global_shape: tuple[int, ...], bounds: Box) -> Shard:
    return Shard(global_shape, bounds)


# Layouts are immutable and engines declare the same ones again and again (a publisher re-created
# per test calls ``plain`` for every tensor): equal arguments share one validated object.
@lru_cache(maxsize=4096, typed=True)
def _plain(cls, name, dtype, global_shape, split_dim, num_shards, shard_idx, logical, shape, replicated) -> TensorLayout:
    func = f"TensorLayout.plain {name!r}"
    if split_dim is None:
        if num_shards != 1 or shard_idx != 0:
            raise LayoutError(
                f"{func}: split_dim=None but num_shards={num_shards}, shard_idx={shard_idx}; "
                "expected 1 and 0 for a whole tensor"
            )
    elif isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise LayoutError(f"{func}: num_shards={num_shards!r} invalid; expected an int >= 1")
    elif isinstance(shard_idx, bool) or not isinstance(shard_idx, int) or not 0 <= shard_idx < num_shards:
        raise LayoutError(f"{func}: shard_idx={shard_idx!r} out of range; expected 0 <= shard_idx < num_shards={num_shards}")
    try:  # Shard names no tensor: this one does
        shard = Shard(global_shape) if split_dim is None else Shard.split(global_shape, split_dim, num_shards, shard_idx)
    except LayoutError as e:
        raise LayoutError(f"{func}: {e}") from None
    return cls(name, dtype, (Part(logical or name, shard, replicated=replicated),), shape)
