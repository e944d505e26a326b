"""Layouts read from PyTorch's DTensor: FSDP2, ``parallelize_module``, 2-D meshes, ``_StridedShard``.

A DTensor knows its global shape, its mesh, its placements and this rank's coordinate: everything a
``TensorLayout`` says. ``dtensor_layout`` reads them and never restates PyTorch's sharding rules:
which global index each local row holds is computed by the placements' own split
(``Placement._split_tensor``, what ``distribute_tensor`` runs) applied to an index vector, one
dimension at a time.

# Note [DTensor boxes]
Placements shard dimensions independently, so the local tensor is a grid: along each dimension
``d`` it holds some list of global indices, and element ``(i, j, ...)`` is global element
``(idx_0[i], idx_1[j], ...)``. A ``Shard`` or a chain of ``Shard`` placements gives one run of
consecutive indices per dimension (one box). ``_StridedShard`` (FSDP2 over a TP-sharded dimension)
gives several runs; the layout then has one part per combination of runs, each at its local offset.
``torch.chunk`` semantics (ceil-sized chunks, possibly empty) come with the placements.

# Note [DTensor replicas]
Other ranks hold this rank's boxes too where a placement is ``Replicate()`` on a mesh dimension of
more than one rank (HSDP's replicate dimension, a TP-replicated parameter), and where the DTensor's
mesh is a slice of a larger root mesh (FSDP over ``mesh["dp"]`` of a 2-D ``(dp, tp)`` mesh: the
other TP ranks' slices hold the same shards). Those parts are marked replicated (Note [Replicated
parts] in ``refit.manifest``), so that receivers accept the overlap; nothing else is.
"""

from __future__ import annotations

import itertools
from typing import Any

from warmlink._dtypes import dtype_name
from warmlink.errors import LayoutError
from warmlink.refit.manifest import Part, Shard, TensorLayout

__all__ = ["is_dtensor", "dtensor_layout", "index_runs", "local_tensor"]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (imports nothing new if not)."""
    import sys

    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(tensor, mod.DTensor)


def local_tensor(tensor: Any) -> Any:
    """The memory this rank holds: a DTensor's local shard (a view, no copy), else ``tensor`` itself.
    Parameters come back as plain tensors over the same storage."""
    t = tensor.to_local() if is_dtensor(tensor) else tensor
    return t.detach()


def index_runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """``(local_start, global_start, length)`` of each run of consecutive global indices."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g:
            ls, gs, n = runs[-1]
            runs[-1] = (ls, gs, n + 1)
        else:
            runs.append((local, g, 1))
    return runs


def _shards(placement: Any) -> bool:
    """Whether ``placement`` splits a dimension (``Shard`` or ``_StridedShard``, whose ``is_shard``
    is False on some PyTorch versions)."""
    from torch.distributed.tensor import placement_types as pt

    kinds = tuple(k for k in (getattr(pt, "Shard", None), getattr(pt, "_StridedShard", None)) if k is not None)
    return placement.is_shard() or isinstance(placement, kinds)


def _global_indices(dt: Any, dim: int, coordinate: list[int]) -> list[int]:
    """Global indices along ``dim`` of this rank's local rows, in local order (Note [DTensor boxes])."""
    import torch

    size = dt.shape[dim]
    view = [1] * dt.ndim
    view[dim] = size
    idx = torch.arange(size, dtype=torch.int64, device="cpu").view(view)
    for mesh_dim, placement in enumerate(dt.placements):
        if _shards(placement) and placement.dim == dim:
            chunks, _ = placement._split_tensor(idx, dt.device_mesh.size(mesh_dim), with_padding=False)
            idx = chunks[coordinate[mesh_dim]] if coordinate[mesh_dim] < len(chunks) else idx.narrow(dim, 0, 0)
    return idx.reshape(-1).tolist()


def dtensor_layout(name: str, dt: Any, *, logical: str | None = None) -> TensorLayout:
    """The layout of this rank's local shard of DTensor ``dt``, named ``name``.

    Args:
        name: physical tensor name (unique per rank).
        dt: a ``DTensor`` whose placements are ``Shard``, ``_StridedShard`` or ``Replicate``.
        logical: the logical tensor's name; default ``name``.

    Returns:
        A ``TensorLayout`` whose parts say which global elements ``dt.to_local()`` holds, where,
        marked replicated where other ranks hold them too (Note [DTensor replicas]).

    Raises:
        LayoutError: a ``Partial`` placement (a pending reduction is no weight), a rank outside the
            mesh, or local and computed shapes that differ (a layout PyTorch describes differently
            than its placements split).

    **Collective?** No (reads local metadata only). **Warm path?** No: call once at setup.
    """
    placements = tuple(dt.placements)
    for p in placements:
        if not (_shards(p) or p.is_replicate()):
            raise LayoutError(
                f"dtensor_layout: tensor {name!r} has placement {p!r}; expected Shard or Replicate (a Partial "
                "placement is a pending reduction: redistribute it first)"
            )
    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError(f"dtensor_layout: tensor {name!r}: this rank is not in its device mesh {dt.device_mesh!r}")
    global_shape = tuple(dt.shape)
    per_dim = [index_runs(_global_indices(dt, d, coordinate)) for d in range(dt.ndim)]
    local = local_tensor(dt)
    want = tuple(sum(n for _, _, n in runs) for runs in per_dim)
    if want != tuple(local.shape):
        raise LayoutError(
            f"dtensor_layout: tensor {name!r}: placements {placements} give local shape {want} but to_local() has "
            f"{tuple(local.shape)}; expected equal (is the local tensor padded or resized?)"
        )
    shape = tuple(local.shape)
    grids: list[list[tuple[int, int, int]]] = [[(0, 0, 0)] if not runs else runs for runs in per_dim]
    replicated = _replicated(dt.device_mesh, placements)
    parts = []
    for combo in itertools.product(*grids):
        bounds = tuple((gs, gs + n) for _, gs, n in combo)
        offset = tuple(ls for ls, _, _ in combo)
        parts.append(Part(logical or name, Shard(global_shape, bounds), offset, replicated=replicated))
    return TensorLayout(name, dtype_name(dt.dtype), tuple(parts), shape)


def _replicated(mesh: Any, placements: tuple) -> bool:
    """Whether other ranks hold this rank's boxes too (Note [DTensor replicas])."""
    if any(p.is_replicate() and mesh.size(d) > 1 for d, p in enumerate(placements)):
        return True
    root = _root_mesh(mesh)
    return root is not None and root.size() > mesh.size()


def _root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself if none): a private API whose name moved."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    try:
        from torch.distributed.device_mesh import _mesh_resources
    except ImportError:  # pragma: no cover - a PyTorch with neither: no slices known
        return None
    return _mesh_resources.get_root_mesh(mesh)
