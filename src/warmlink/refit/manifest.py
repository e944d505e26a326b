"""How tensors are laid out on each side of a refit: shards of logical tensors, possibly fused.

A *logical* tensor is one weight as the model defines it, in global coordinates (``q_proj`` of
layer 3, shape ``[num_heads * head_dim, hidden]``). A *physical* tensor is what one rank holds in
memory: one shard of a logical tensor, or several shards of several logical tensors concatenated
along ``fuse_dim`` (Megatron's fused QKV, vLLM's ``qkv_proj`` and ``gate_up_proj``).

Plans (``warmlink.refit.plan``) intersect the boxes these describe. Everything here is pure data
with validation; nothing touches memory.

See Note [Uneven shards]: a dimension of size ``d`` split ``n`` ways gives the first ``d % n``
shards one extra row, as ``torch.tensor_split`` does, so uneven splits are exact rather than refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Sequence

from warmlink._dtypes import dtype_size
from warmlink.errors import LayoutError

__all__ = ["Shard", "Part", "TensorLayout", "split_bounds"]


def split_bounds(size: int, num_shards: int, shard_idx: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``shard_idx`` when ``size`` is split ``num_shards`` ways.

    # Note [Uneven shards]
    The first ``size % num_shards`` shards hold ``size // num_shards + 1`` rows, the rest
    ``size // num_shards`` (``torch.tensor_split`` semantics). A split that would leave a shard
    empty is rejected: no framework lays weights out that way and it is always a config error.
    """
    if num_shards < 1:
        raise LayoutError(f"split_bounds: num_shards={num_shards!r} must be >= 1")
    if not 0 <= shard_idx < num_shards:
        raise LayoutError(f"split_bounds: shard_idx={shard_idx!r} out of range; expected 0 <= shard_idx < {num_shards}")
    if size < num_shards:
        raise LayoutError(f"split_bounds: size={size} cannot be split {num_shards} ways without an empty shard")
    base, extra = divmod(size, num_shards)
    start = shard_idx * base + min(shard_idx, extra)
    stop = start + base + (1 if shard_idx < extra else 0)
    return start, stop


@dataclass(frozen=True)
class Shard:
    """Which block of a logical tensor one rank holds.

    Args:
        global_shape: shape of the whole logical tensor.
        split_dim: dimension split across ranks; ``None`` when every rank holds all of it.
        num_shards: how many ways ``split_dim`` is split (1 when ``split_dim`` is None).
        shard_idx: which of those blocks this rank holds, ``0 <= shard_idx < num_shards``. Several
            ranks may hold the same block (grouped-query KV heads replicated when TP > num_kv_heads).
    """

    global_shape: tuple[int, ...]
    split_dim: int | None = None
    num_shards: int = 1
    shard_idx: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        if any(d < 0 for d in self.global_shape):
            raise LayoutError(f"Shard: global_shape={self.global_shape} has a negative dimension")
        if self.split_dim is None:
            if self.num_shards != 1 or self.shard_idx != 0:
                raise LayoutError(
                    f"Shard: split_dim=None but num_shards={self.num_shards}, shard_idx={self.shard_idx}; "
                    "expected 1 and 0 for a replicated tensor"
                )
            return
        ndim = len(self.global_shape)
        if not 0 <= self.split_dim < ndim:
            raise LayoutError(f"Shard: split_dim={self.split_dim} out of range for global_shape={self.global_shape}")
        split_bounds(self.global_shape[self.split_dim], self.num_shards, self.shard_idx)

    def box(self) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` per dimension, in global coordinates."""
        bounds = [(0, d) for d in self.global_shape]
        if self.split_dim is not None:
            bounds[self.split_dim] = split_bounds(self.global_shape[self.split_dim], self.num_shards, self.shard_idx)
        return tuple(bounds)

    # Layouts are immutable: derived values are computed once (cached_property writes the
    # instance __dict__, which a frozen dataclass allows; equality and hashing use fields only).
    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box())


@dataclass(frozen=True)
class Part:
    """One logical tensor's shard stored inside a physical tensor."""

    logical: str
    shard: Shard


@dataclass(frozen=True)
class TensorLayout:
    """A physical tensor one rank holds: its name, dtype and the logical shards inside it.

    ``parts`` are concatenated along ``fuse_dim`` in order; a plain tensor has one part. All parts
    must agree on every dimension except ``fuse_dim``.
    """

    name: str
    dtype: str
    parts: tuple[Part, ...]
    fuse_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        if not self.name:
            raise LayoutError("TensorLayout: name='' is empty")
        dtype_size(self.dtype)
        if not self.parts:
            raise LayoutError(f"TensorLayout {self.name!r}: parts=() is empty; expected at least one Part")
        shapes = [p.shard.local_shape for p in self.parts]
        ndim = len(shapes[0])
        if any(len(s) != ndim for s in shapes):
            raise LayoutError(f"TensorLayout {self.name!r}: parts have different ranks {shapes}")
        if len(self.parts) > 1 and not 0 <= self.fuse_dim < ndim:
            raise LayoutError(f"TensorLayout {self.name!r}: fuse_dim={self.fuse_dim} out of range for rank {ndim}")
        for s in shapes[1:]:
            for d in range(ndim):
                if d != self.fuse_dim and s[d] != shapes[0][d]:
                    raise LayoutError(
                        f"TensorLayout {self.name!r}: fused parts disagree on dim {d} ({shapes}); "
                        f"only fuse_dim={self.fuse_dim} may differ"
                    )
        logicals = [p.logical for p in self.parts]
        if len(set(logicals)) != len(logicals):
            raise LayoutError(f"TensorLayout {self.name!r}: a logical tensor appears twice in parts {logicals}")

    def __hash__(self) -> int:
        # Kept by @dataclass (an explicit __hash__ wins). Layouts key plan and signature caches,
        # and the generated hash would walk every part and shard on every lookup.
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.name, self.dtype, self.parts, self.fuse_dim))
        return h

    def __getstate__(self) -> dict:
        # The cached hash is per process (str hashes are salted): never pickled to another one.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

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
    ) -> "TensorLayout":
        """A physical tensor holding one shard of one logical tensor (named ``logical or name``)."""
        args = (cls, name, dtype, tuple(global_shape), split_dim, num_shards, shard_idx, logical)
        try:
            return _plain(*args)
        except TypeError:  # an unhashable argument: build it uncached (and report what is wrong)
            return _plain.__wrapped__(*args)

    @classmethod
    def fused(
        cls,
        name: str,
        dtype: str,
        parts: Sequence[tuple[str, Shard]],
        fuse_dim: int = 0,
    ) -> "TensorLayout":
        """Several logical shards concatenated along ``fuse_dim`` (e.g. ``[q; k; v]`` per rank)."""
        return cls(name, dtype, tuple(Part(logical, shard) for logical, shard in parts), fuse_dim)

    # -- derived ---------------------------------------------------------------------------------
    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        shapes = [p.shard.local_shape for p in self.parts]
        if len(shapes) == 1:
            return shapes[0]
        out = list(shapes[0])
        out[self.fuse_dim] = sum(s[self.fuse_dim] for s in shapes)
        return tuple(out)

    @cached_property
    def numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n

    @cached_property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)

    def part_offsets(self) -> list[int]:
        """Start of each part along ``fuse_dim`` in this tensor's local coordinates."""
        offsets, at = [], 0
        for p in self.parts:
            offsets.append(at)
            at += p.shard.local_shape[self.fuse_dim] if len(self.parts) > 1 else 0
        return offsets

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "fuse_dim": self.fuse_dim,
            "parts": [
                {
                    "logical": p.logical,
                    "global_shape": list(p.shard.global_shape),
                    "split_dim": p.shard.split_dim,
                    "num_shards": p.shard.num_shards,
                    "shard_idx": p.shard.shard_idx,
                }
                for p in self.parts
            ],
        }

    @classmethod
    def from_json(cls, obj: dict) -> "TensorLayout":
        """Inverse of ``to_json`` for an object already checked by ``rendezvous.schema``."""
        parts = tuple(
            Part(
                p["logical"],
                Shard(tuple(p["global_shape"]), p["split_dim"], p["num_shards"], p["shard_idx"]),
            )
            for p in obj["parts"]
        )
        return cls(obj["name"], obj["dtype"], parts, obj.get("fuse_dim", 0))


# Layouts are immutable and engines declare the same ones again and again (a publisher re-created
# per test calls ``plain`` for every tensor): equal arguments share one validated object.
@lru_cache(maxsize=4096, typed=True)
def _plain(cls, name, dtype, global_shape, split_dim, num_shards, shard_idx, logical) -> TensorLayout:
    shard = Shard(global_shape, split_dim, num_shards, shard_idx)
    return cls(name, dtype, (Part(logical or name, shard),))
