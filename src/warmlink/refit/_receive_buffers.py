"""A receiver's memory for one plan: receive and scratch space in one registered region.

Made and kept by the receive state's buffer cache (``refit._parked``), which decides how long a
set lives: across cycles with pooling on, one cycle with pooling off.
"""

from __future__ import annotations

from warmlink._dtypes import torch_dtype
from warmlink.pool.core import SharedCache
from warmlink.refit._chunks import chunking, split_copies
from warmlink.transport.base import Copy

__all__ = ["ReceiveBuffers", "direct_target"]

_ALIGN = 256


def direct_target(tp, target, device: int):
    """``target`` when tensor plan ``tp`` can be pulled straight into it (install ``"direct"``): no
    cast and no staged pull to translate afterwards, contiguous, on the link's device; else None."""
    if target is None or tp.needs_cast or tp.staged or not target.is_contiguous():
        return None
    on = -1 if target.device.type == "cpu" else target.device.index
    return target if on == device and target.numel() else None


class ReceiveBuffers:
    """Receive + scratch memory for ``plan``, leased from ``link``; ``close`` gives it back.

    ``recv[i]`` is tensor i as pulled (source dtype, destination shape), ``scratch[i]`` the bytes
    its staged pulls land in (None when it has none), ``final[i]`` what is installed: ``recv[i]``
    itself, or a tensor of the destination dtype that a cast fills. With ``direct[i]`` (install
    ``"direct"``: ``targets[i]`` passed ``direct_target``) the pull lands in the target itself:
    ``recv[i]`` and ``final[i]`` are the target, and no receive memory is taken for it.
    """

    __slots__ = ("link", "region", "recv_offsets", "scratch_offsets", "recv", "scratch", "final", "direct",
                 "_direct_regions", "_batches", "_chunked")

    def __init__(self, link, plan, targets=None) -> None:
        import torch

        self.link = link
        self.direct = [direct_target(tp, t, link.device) for tp, t in zip(plan.tensors, targets)] \
            if targets is not None else [None] * len(plan.tensors)
        # Straight into the model: the link's local view of each target (not announced to peers).
        self._direct_regions = [link.local_region(t) if t is not None else None for t in self.direct]
        self.recv_offsets, self.scratch_offsets, total = [], [], 0
        for tp, d in zip(plan.tensors, self.direct):
            self.recv_offsets.append(total)
            total += 0 if d is not None else _round(tp.recv_nbytes)
            self.scratch_offsets.append(total)
            total += _round(tp.scratch_nbytes)
        self.region = link.allocate(max(total, _ALIGN))
        buf = self.region.tensor
        # One torch op per tensor (a typed view of the whole buffer per dtype, then as_strided):
        # a re-created receiver builds these views again and slicing costs three ops each.
        # Offsets are multiples of _ALIGN, hence of every itemsize; buf's length is too.
        typed: dict[str, object] = {}
        self.recv = []
        for tp, o, d in zip(plan.tensors, self.recv_offsets, self.direct):
            if d is not None:
                self.recv.append(d)
                continue
            view = typed.get(tp.src_dtype)
            if view is None:
                view = typed[tp.src_dtype] = buf.view(torch_dtype(tp.src_dtype))
            self.recv.append(view.as_strided(tp.dst_shape, _contiguous_strides(tp.dst_shape),
                                             view.storage_offset() + o // view.element_size()))
        # Padding is never written by a pull: zeroed once here, it stays zero (Note [Layout rules]);
        # a target pulled into directly has its padding zeroed here too, as a copy install would.
        for tp, r in zip(plan.tensors, self.recv):
            if tp.padded:
                r.zero_()
        # Scratch only where staged pulls land (translate.unstage is the only reader).
        self.scratch = [buf[o : o + tp.scratch_nbytes] if tp.staged else None
                        for tp, o in zip(plan.tensors, self.scratch_offsets)]
        # Casts land in plain tensors of the destination dtype, made once with the buffers.
        self.final = [
            torch.zeros(tp.dst_shape, dtype=torch_dtype(tp.dst_dtype), device=buf.device) if tp.needs_cast else r
            for tp, r in zip(plan.tensors, self.recv)
        ]
        # The copy batch filling these buffers, by the sources it was prepared for: a publisher
        # re-created with other regions needs another batch, the same buffers do not.
        self._batches = SharedCache("receive_batch", counted=False, max_entries=1)
        self._chunked = SharedCache("receive_chunks", counted=False, max_entries=1)

    def batch(self, plan, sources):
        """The prepared copy batch that fills these buffers from ``sources`` (a ``SourceSet``);
        prepared once per sources (with pooling on). Opens the regions it reads."""
        return self._batches.get(sources.opened_key(), lambda _key: self.link.prepare(self._copies(plan, sources)))

    def chunked(self, plan, sources, chunk_bytes: int) -> tuple:
        """For fan-out (Note [Fan-out] in ``refit._relay``): ``(chunks, batches)``, the region cut
        into chunks of at most ``chunk_bytes`` served bytes (a ``refit._chunks.Chunking``) and per
        chunk the prepared batch of the pulls from ``sources`` that fill it (None for a chunk they
        leave unwritten); prepared once per sources (with pooling on). Opens the regions it reads."""
        return self._chunked.get((sources.opened_key(), chunk_bytes), lambda _key: self._chunk(plan, sources, chunk_bytes))

    def _chunk(self, plan, sources, chunk_bytes: int) -> tuple:
        copies = self._copies(plan, sources)
        chunks = chunking(copies, chunk_bytes)
        return chunks, [self.link.prepare(part) if part else None for part in split_copies(copies, chunks)]

    def _copies(self, plan, sources) -> list[Copy]:
        copies = []
        for i, tp in enumerate(plan.tensors):
            base, scratch = self.recv_offsets[i], self.scratch_offsets[i]
            local = self._direct_regions[i]
            if local is not None:
                base = 0
            else:
                local = self.region
            for run in tp.runs:
                remote, offset = sources.region_of(run.src_rank, run.src_tensor)
                copies.append(Copy(local, base + run.dst_offset, remote, offset + run.src_offset,
                                   run.row_nbytes, run.num_rows, run.dst_pitch, run.src_pitch))
            for sp in tp.staged:
                remote, offset = sources.region_of(sp.src_rank, sp.src_tensor)
                into = scratch + sp.scratch_offset
                if sp.runs:  # one box gathered compactly (Note [Transposed parts] in refit.manifest)
                    copies.extend(Copy(self.region, into + r.dst_offset, remote, offset + r.src_offset, r.row_nbytes,
                                       r.num_rows, r.dst_pitch, r.src_pitch) for r in sp.runs)
                else:
                    copies.append(Copy(self.region, into, remote, offset, sp.src_nbytes))
        return copies

    def close(self) -> None:
        """Give the region back to the link's arenas. Safe to call twice (``Link.release`` is)."""
        self._batches.clear()
        self._chunked.clear()
        for region in self._direct_regions:
            if region is not None:
                self.link.release(region)
        self.link.release(self.region)

    def __repr__(self) -> str:
        return f"ReceiveBuffers(tensors={len(self.recv)}, nbytes={self.region.nbytes})"


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))
