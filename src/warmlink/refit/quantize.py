"""Quantize on send: a publisher's live weights into FP8 values and scales in its staging memory.

``declare`` turns one declared weight into the two tensors a publisher publishes in its place (FP8
values, float32 scales: Note [FP8 formats] in ``refit.fp8``); at every publish the publisher's
``Quantizer`` rebuilds both from the live weights (Note [Live sources] in ``refit._declare``).

A ``Quantizer`` runs each weight part by part (a part: one box of one logical weight, read where
the weight lives). Where every part holds its scale cells (Note [Where FP8 is quantized] in
``refit.fp8``) each part is quantized alone: on a GPU by one kernel launch per part that reads the
weight once and writes values and scales (``refit._fp8_triton``), else with torch ops. Otherwise
it takes three steps over all weights at once: every part's cell amaxes into one float32 buffer
(one segment per logical weight, its whole cell grid), one max all-reduce of that buffer over the
group, then values and scales from the reduced cells.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any, Mapping

from warmlink._dtypes import dtype_name
from warmlink.errors import ConfigError, LayoutError
from warmlink.refit._declare import Declared, Fill
from warmlink.refit import _fp8_layout as fp8_layout
from warmlink.refit.dtensor import local_tensor
from warmlink.refit.manifest import TensorLayout

__all__ = ["Fp8Weight", "declare", "declare_module", "Quantizer", "KERNELS"]

log = logging.getLogger("warmlink.refit")

KERNELS = ("auto", "torch", "triton")


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


class Fp8Weight:
    """One quantized published tensor: the weight's layout and fills (where its parts are read), the
    scheme, and the names of the values and scales tensors published in its place."""

    __slots__ = ("name", "scale_name", "layout", "scale_layout", "scheme", "_reads")

    def __init__(self, weight: Declared, scheme: str, func: str) -> None:
        self.name, self.layout, self.scheme = weight.name, weight.layout, scheme
        self.scale_name = fp8_layout.scale_name(weight.name, scheme)
        self.scale_layout = fp8_layout.scale_layout(weight.layout, scheme, func)
        fills = weight.staging_fills()
        self._reads = tuple(_find_fill(p, fills, weight.layout, func) for p in weight.layout.parts)

    def part_views(self):
        """Each part's live weight, shaped as its box (``Part.shard.local_shape``) in the layout's
        dtype: views where the memory and dtype allow (Note [Live sources] in ``refit._declare``:
        re-read at every publish). A weight cast on publish (FP32 master weights declared BF16) is
        quantized from the values the cast gives, as an engine loading that BF16 checkpoint would."""
        import torch

        dtype = getattr(torch, self.layout.dtype)
        out = []
        for part, fill in zip(self.layout.parts, self._reads):
            src = local_tensor(fill.source)
            src = src[_slices(part.local_box())] if fill.src_box is None else src[_slices(fill.src_box)]
            out.append(src.reshape(part.shard.local_shape).to(dtype))
        return out

    def __repr__(self) -> str:
        return f"Fp8Weight({self.name!r}, scheme={self.scheme!r})"


def _find_fill(part, fills: tuple[Fill, ...], layout: TensorLayout, func: str) -> Fill:
    """The fill that writes ``part``: the whole published tensor (in place or cast), or one of the
    part's own box (a layout built from whole logical tensors, ``declare_module``)."""
    whole = tuple((0, d) for d in layout.shape)
    for f in fills:
        if (f.src_box is None and tuple(f.dst_box) == whole) or (f.src_box == part.shard.bounds
                                                                 and tuple(f.dst_box) == part.local_box()):
            return f
    raise LayoutError(f"{func}: tensor {layout.name!r} part of logical={part.logical!r} is built from pieces of several "
                      "tensors; expected each quantized part read from one tensor")


def declare(weight: Declared, fp8, func: str) -> list[Declared]:
    """The FP8 values and scales published in place of ``weight`` (``fp8``: a ``refit.fp8.Fp8``).

    Raises:
        LayoutError: a weight that is not floating point of 2 or more dims, a transposed or
            block-unaligned fused layout, or (without ``fp8.group``) a part that does not hold its
            scale cells (Note [Where FP8 is quantized] in ``refit.fp8``), naming the tensor.
    """
    layout = weight.layout
    if layout.dtype not in ("bfloat16", "float16", "float32"):
        raise LayoutError(f"{func}: tensor {weight.name!r} dtype={layout.dtype!r}; expected a bfloat16, float16 or float32 "
                          "weight to quantize to FP8")
    w = Fp8Weight(weight, fp8_layout.check_scheme(fp8.scheme, func), func)
    if fp8.group is None:
        for p in layout.parts:
            if fp8_layout.holds_cells(p.shard.bounds, p.shard.global_shape, fp8.scheme) and (
                    fp8.scheme != "tensor" or sum(q.shard.numel for q in layout.parts if q.logical == p.logical)
                    == math.prod(p.shard.global_shape)):
                continue
            raise LayoutError(
                f"{func}: tensor {weight.name!r} holds box={p.shard.bounds} of logical={p.logical!r} "
                f"{p.shard.global_shape}, which splits its {fp8.scheme!r} scale cells with other ranks; expected "
                + {"block": "cuts at multiples of 128", "channel": "whole rows",
                   "tensor": "the whole tensor"}[fp8.scheme]
                + ", or Fp8(group=...) naming the trainer's process group, over which cell amaxes are reduced "
                "(Note [Where FP8 is quantized])")
    fills = weight.staging_fills()
    return [Declared(w.name, fp8_layout.values_layout(layout), None, fills, quantized=w),
            Declared(w.scale_name, w.scale_layout, None, fills, quantized=w)]


def declare_module(declared: list[Declared], fp8, func: str) -> list[Declared]:
    """``declared`` with each tensor holding weights of ``fp8.logical`` replaced by its FP8 values
    and scales (``declare``).

    Raises:
        ConfigError: ``fp8.logical`` is None.
        LayoutError: a name of ``fp8.logical`` that no tensor holds, a tensor holding some of them
            beside others, or as ``declare``.
    """
    if fp8.logical is None:
        raise ConfigError(f"{func}: fp8.logical=None; expected the logical tensors to quantize "
                          "(Fp8(logical=families.fp8_weights(config)))")
    out, held = [], set()
    for d in declared:
        logicals = {p.logical for p in d.layout.parts}
        if not logicals & fp8.logical:
            out.append(d)
            continue
        if logicals - fp8.logical:
            raise LayoutError(f"{func}: tensor {d.name!r} holds {sorted(logicals - fp8.logical)} besides weights "
                              "fp8.logical names; expected a tensor holding quantized weights only")
        held |= logicals
        out += declare(d, fp8, func)
    missing = sorted(fp8.logical - held)
    if missing:
        raise LayoutError(f"{func}: fp8.logical names {missing[:5]}{' ...' if len(missing) > 5 else ''}, held by no "
                          "tensor of the module; expected names of its logical tensors")
    return out


class Quantizer:
    """Writes the FP8 values and scales of quantized weights from the live weights, on their device.

    Args:
        items: ``(weight, values, scales)`` per quantized tensor: its ``Fp8Weight`` and the
            tensors its values (float8_e4m3fn, ``weight.layout.shape``) and scales (float32,
            ``weight.scale_layout.shape``) are written into (the publisher's staging views).
        scheme: every item's scheme (one per publisher).
        group: a ``torch.distributed`` process group over which cell amaxes are max-reduced, or None.
        kernel: ``"auto"`` (a Triton kernel for blocks on CUDA where every part holds its cells and
            Triton imports, else torch ops), ``"torch"`` or ``"triton"``.

    Raises:
        ConfigError: a bad kernel, or ``"triton"`` where it cannot run.

    **Collective?** ``run`` and ``check_group`` are, over ``group`` when given. **Warm path?**
    ``run`` allocates only what torch ops need for temporaries (none on the Triton path).
    """

    def __init__(self, items, scheme: str, group=None, kernel: str = "auto") -> None:
        import torch

        if kernel not in KERNELS:
            raise ConfigError(f"Quantizer: kernel={kernel!r} is unknown; expected one of {list(KERNELS)}")
        self.items = list(items)
        self.scheme = fp8_layout.check_scheme(scheme, "Quantizer")
        self.group = group
        # where the weights live, and the work is done (the outputs may be elsewhere: a CUDA
        # trainer staging over shm)
        self.device = self.items[0][0].part_views()[0].device if self.items else torch.device("cpu")
        self._kernel = self._choose(kernel)
        self._cells = None
        self._logical_cells: dict[str, Any] = {}
        if self._kernel == "torch":
            self._make_cells()

    @classmethod
    def standalone(cls, weights: Mapping[str, Any], scheme: str = "block", kernel: str = "auto") -> "Quantizer":
        """A quantizer of whole tensors, each its own logical weight, with outputs of its own
        (``outputs[name] = (values, scales)``): what ``warmlink bench fp8`` times."""
        import torch

        items = []
        for name, t in weights.items():
            layout = TensorLayout.plain(name, dtype_name(t.dtype), tuple(t.shape))
            w = Fp8Weight(Declared(name, layout, t), scheme, "Quantizer.standalone")
            items.append((w, torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device),
                          torch.empty(w.scale_layout.shape, dtype=torch.float32, device=t.device)))
        q = cls(items, scheme, None, kernel)
        q.outputs = {w.name: (v, s) for w, v, s in items}
        return q

    @property
    def kernel(self) -> str:
        """``"triton"`` or ``"torch"``: what ``run`` uses."""
        return self._kernel

    def _choose(self, kernel: str) -> str:
        local = self.group is None and all(fp8_layout.holds_cells(p.shard.bounds, p.shard.global_shape, self.scheme)
                                           for w, _, _ in self.items for p in w.layout.parts)
        fits = (self.scheme == "block" and local and self.device.type == "cuda"
                and all(v.device == self.device and s.device == self.device for _, v, s in self.items))
        if kernel == "torch" or (kernel == "auto" and not fits):
            return "torch"
        if not fits:
            raise ConfigError(f"Quantizer: kernel='triton' needs scheme='block', weights and outputs on one CUDA device, "
                              f"every part holding its cells and no group; got scheme={self.scheme!r} on {self.device}")
        try:
            from warmlink.refit import _fp8_triton  # noqa: F401 - Triton imports here or not at all
        except ImportError as e:
            if kernel == "triton":
                raise ConfigError(f"Quantizer: kernel='triton' but Triton does not import ({e})") from None
            log.info("FP8 quantizer uses torch ops: Triton does not import", extra={"error": str(e)})
            return "torch"
        return "triton"

    def _make_cells(self) -> None:
        """One float32 buffer holding every logical weight's cell grid (sorted by name: the same
        order on every rank of the group), and a view of it per logical weight."""
        import torch

        shapes: dict[str, tuple[int, ...]] = {}
        for w, _, _ in self.items:
            for p in w.layout.parts:
                shapes.setdefault(p.logical, fp8_layout.scale_global_shape(p.shard.global_shape, self.scheme))
        total = sum(math.prod(s) for s in shapes.values())
        self._cells = torch.zeros(total, dtype=torch.float32, device=self.device)
        at = 0
        for logical in sorted(shapes):
            n = math.prod(shapes[logical])
            self._logical_cells[logical] = self._cells[at:at + n].view(shapes[logical])
            at += n
        self._shapes = shapes

    def check_group(self) -> None:
        """With a group: that every rank of it quantizes the same logical weights of the same
        shapes (their cells are reduced position by position). Collective over the group.

        Raises:
            ConfigError: the ranks' sets differ.
        """
        if self.group is None:
            return
        import torch
        import torch.distributed as dist

        raw = repr(sorted(self._shapes.items())).encode()
        digest = int.from_bytes(hashlib.sha256(raw).digest()[:7], "little")
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if int(both[0]) != -int(both[1]):
            raise ConfigError("Publisher.export: the ranks of Fp8(group=...) quantize different logical tensors or shapes; "
                              "expected the same quantized weights on every rank of the group (its tensor-parallel "
                              "group: each rank holding a shard of every one)")

    def run(self) -> None:
        """Write every item's values and scales from its live weight (Note [FP8 formulas])."""
        import torch

        with torch.no_grad():
            if self._kernel == "triton":
                self._run_triton()
            else:
                self._run_torch()

    def _run_triton(self) -> None:
        from warmlink.refit import _fp8_triton

        for w, values, scales in self.items:
            for part, view, sp in zip(w.layout.parts, w.part_views(), w.scale_layout.parts):
                if part.shard.numel == 0:
                    continue
                _fp8_triton.block_fp8_(view, _region(values, part), _region(scales, sp))

    def _run_torch(self) -> None:
        import torch

        from warmlink.refit import _fp8_math

        work = []
        self._cells.zero_()
        for w, values, scales in self.items:
            by_logical = {p.logical: p for p in w.scale_layout.parts}  # a tensor scheme's one cell per logical
            for i, (part, view) in enumerate(zip(w.layout.parts, w.part_views())):
                if part.shard.numel == 0:
                    continue
                box = part.shard.bounds
                cells = self._logical_cells[part.logical][
                    _slices(fp8_layout.cell_box(box, part.shard.global_shape, self.scheme))]
                r0, c0 = box[-2][0], box[-1][0]
                torch.maximum(cells, _fp8_math.amax(view, self.scheme, r0, c0), out=cells)
                sp = (by_logical[fp8_layout.scale_name(part.logical, self.scheme)] if self.scheme == "tensor"
                      else w.scale_layout.parts[i])
                work.append((view, cells, _region(values, part), _region(scales, sp), r0, c0))
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(self._cells, op=dist.ReduceOp.MAX, group=self.group)
        _fp8_math.scales_(self._cells, self.scheme)
        for view, cells, values, scales, r0, c0 in work:
            _fp8_math.quantize(view, cells, self.scheme, values, r0, c0)
            scales.copy_(cells)


def _region(physical, part):
    """Where ``part`` lies in ``physical``, shaped as its box: a view (what is written lands there)."""
    return physical[_slices(part.local_box())].view(part.shard.local_shape)
