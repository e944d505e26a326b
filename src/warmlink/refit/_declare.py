"""What a publisher reads: live tensors, never copies the caller must remember to refresh.

Every published tensor is one of two kinds.

* **In place**: the memory of a live tensor (a parameter, a buffer, a DTensor's local shard) whose
  layout is exactly what is published. Receivers read it where it is when the transport can share
  that memory; otherwise the publisher copies it into its staging arena at every ``publish``.
* **Built**: a layout the trainer does not hold as one tensor (a fused ``[q; k; v]`` cut from full
  tensors, a dtype cast, FP8 values and their scales). It is rebuilt from the live tensors into the
  staging arena at every ``publish``, so a version always holds the bytes of the moment it was
  published.

# Note [Live sources]
A source is kept as the object the caller handed over (a ``Parameter``, a ``DTensor``) and its
memory is re-read through it at every publish (``local_tensor``): an optimizer that replaces a
parameter's ``.data`` is then either followed (built and staged tensors) or caught (in-place
tensors whose memory moved since export raise ``LayoutError`` instead of publishing the old bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from warmlink._dtypes import dtype_name
from warmlink.errors import LayoutError
from warmlink.refit.dtensor import dtensor_layout, is_dtensor, local_tensor
from warmlink.refit.manifest import TensorLayout

__all__ = ["Fill", "Declared", "declare_tensor", "declare_module", "module_tensors"]


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@dataclass(frozen=True)
class Fill:
    """Copy ``source[src_box]`` (global coordinates of a full source tensor; ``None``: all of it)
    into the published tensor at ``dst_box`` (local coordinates), casting to the published dtype."""

    source: Any
    src_box: tuple | None
    dst_box: tuple


@dataclass
class Declared:
    """One published tensor: its layout, the live object it reads and, for built tensors, how."""

    name: str
    layout: TensorLayout
    source: Any  # in place: the live tensor (Note [Live sources]); built: None
    fills: tuple[Fill, ...] = ()
    # FP8 values or scales of a weight (refit.quantize.Fp8Weight), written by the publisher's
    # Quantizer from the weight's fills rather than copied by them (Note [Where FP8 is quantized] in refit.fp8)
    quantized: Any = None

    @property
    def in_place(self) -> bool:
        return self.source is not None

    def memory(self):
        """The tensor whose bytes are published in place (in-place entries only)."""
        return local_tensor(self.source)

    def data_ptr(self) -> int:
        """Where the in-place memory is now (cheap: checked at every publish)."""
        src = self.source
        return (src.to_local() if is_dtensor(src) else src).data_ptr()

    def device(self):
        return local_tensor(self.source if self.in_place else self.fills[0].source).device

    def staging_fills(self) -> tuple[Fill, ...]:
        """What ``publish`` copies when this tensor is staged: the whole live tensor if in place."""
        return (Fill(self.source, None, tuple((0, d) for d in self.layout.shape)),) if self.in_place else self.fills


def run_fills(fills: tuple[Fill, ...], out) -> None:
    """Copy every fill into ``out`` (a tensor of the published layout's shape and dtype)."""
    for f in fills:
        src = local_tensor(f.source)
        if f.src_box is not None:
            src = src[_slices(f.src_box)]
        target = out[_slices(f.dst_box)]
        target.copy_(src.reshape(target.shape))


def declare_tensor(name: str, tensor: Any, layout: TensorLayout | None, dtype: str | None = None) -> Declared:
    """A tensor published as it is (in place), or cast to ``dtype`` (built).

    Raises:
        LayoutError: ``tensor`` is not a tensor, or its local shape or dtype differs from ``layout``,
            or it is not contiguous.
    """
    if isinstance(tensor, TensorLayout) or not hasattr(tensor, "is_contiguous"):
        raise LayoutError(f"Publisher.add: name={name!r}: tensor is a {type(tensor).__name__}; expected a torch.Tensor "
                          "(the order is add(name, tensor, layout), where Receiver.add takes (name, layout, target))")
    if layout is not None and not isinstance(layout, TensorLayout):
        raise LayoutError(f"Publisher.add: name={name!r}: layout is a {type(layout).__name__}; expected a TensorLayout or None")
    local = local_tensor(tensor)
    have = dtype_name(local.dtype)
    if layout is None:
        layout = dtensor_layout(name, tensor) if is_dtensor(tensor) else TensorLayout.plain(name, have, tuple(local.shape))
        if dtype is not None and dtype != have:
            layout = TensorLayout(layout.name, dtype, layout.parts, layout.shape)
    elif is_dtensor(tensor):
        held = dtensor_layout(name, tensor)
        boxes = lambda lay: [(p.shard, p.offset) for p in lay.parts]  # noqa: E731 - logical names are the caller's
        if boxes(held) != boxes(layout) or held.shape != layout.shape:
            raise LayoutError(
                f"Publisher.add: tensor {name!r} is a DTensor holding {[p.shard.bounds for p in held.parts]} of "
                f"{[p.logical for p in held.parts]}; the layout given says {[p.shard.bounds for p in layout.parts]} of "
                f"{[p.logical for p in layout.parts]}; expected equal (omit layout to read it from the placements)"
            )
        if [p.replicated for p in held.parts] != [p.replicated for p in layout.parts]:
            # the placements know which boxes other ranks hold (Note [DTensor replicas]); a hand-written layout may not
            layout = TensorLayout(layout.name, layout.dtype, tuple(replace(p, replicated=h.replicated)
                                                                   for p, h in zip(layout.parts, held.parts)), layout.shape)
    if layout.name != name:
        raise LayoutError(f"Publisher.add: name={name!r} but layout.name={layout.name!r}")
    if tuple(local.shape) != layout.local_shape:
        raise LayoutError(f"Publisher.add: tensor {name!r} shape={tuple(local.shape)}; expected layout.local_shape={layout.local_shape}")
    if not local.is_contiguous():
        raise LayoutError(f"Publisher.add: tensor {name!r} is not contiguous; expected a contiguous tensor")
    if have == layout.dtype:
        return Declared(name, layout, tensor)
    # A cast is a copy: rebuilt from the live tensor at every publish.
    return Declared(name, layout, None, (Fill(tensor, None, tuple((0, d) for d in layout.shape)),))


def module_tensors(module) -> dict[str, Any]:
    """Parameters (each once, as ``named_parameters`` lists tied weights) and persistent buffers
    (trained state such as DeepSeek-V3's ``e_score_correction_bias``) of ``module``, by name."""
    out = dict(module.named_parameters())
    persistent = set(module.state_dict(keep_vars=True))
    for name, buf in module.named_buffers():
        if name in persistent and name not in out:
            out[name] = buf
    return out


def declare_module(module, layouts: Mapping[str, TensorLayout] | None, dtype: str | None) -> list[Declared]:
    """Every tensor ``Publisher.add_module`` publishes. See its docstring."""
    tensors = module_tensors(module)
    if layouts is None:
        return [declare_tensor(name, t, None, dtype) for name, t in tensors.items()]
    out = []
    for phys, layout in layouts.items():
        if not isinstance(layout, TensorLayout) or layout.name != phys:
            raise LayoutError(f"Publisher.add_module: layouts[{phys!r}]={layout!r} invalid; expected a TensorLayout named {phys!r}")
        held = tensors.get(phys)
        if held is not None and tuple(local_tensor(held).shape) == layout.local_shape:
            out.append(declare_tensor(phys, held, layout))
            continue
        fills = []
        for part in layout.parts:
            src = tensors.get(part.logical)
            if src is None or is_dtensor(src) or tuple(src.shape) != part.shard.global_shape:
                have = "absent" if src is None else ("a DTensor" if is_dtensor(src) else f"of shape {tuple(src.shape)}")
                raise LayoutError(
                    f"Publisher.add_module: layout {phys!r} needs logical tensor {part.logical!r} of global shape "
                    f"{part.shard.global_shape}; the module's {part.logical!r} is {have}; expected either a module tensor "
                    f"named {phys!r} of shape {layout.local_shape}, or every part's logical tensor whole in the module"
                )
            fills.append(Fill(src, part.shard.bounds, part.local_box()))
        out.append(Declared(phys, layout, None, tuple(fills)))
    return out
