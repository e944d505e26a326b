"""How rows reach a peer's region: host copies (``HostMover``, shm) or copy engines and SM pushes
(``CudaMover``, cuda_ipc: ep.paths.cuda_mover).

Both movers offer the same operations, so the senders (ep.paths.senders) and the combine
(ep.paths.combine) hold one protocol for both backends:

- ``begin(copies)``: later pushes are ordered after the caller's stream;
- ``gather(rows, src, dests, skip)``: the rows (and meta rows) of ``src`` bound for ``dests``
  (but ``skip``) go into this rank's staging slots (ep.kernels.steps.gather); staging needs no peer,
  and a row's place in the peer may be known only after the handshake;
- ``flush(dest, phase, src, row0, count, parts)``: ``count`` staged rows of ``src`` in ``dest``'s
  slot go to rows ``row0...`` of its areas ``parts``, then are marked sent; ``flush_all(phase,
  src, parts, plan)`` several destinations at once;
- ``place_local(rows, src, parts, shift)``: this rank's own rows straight into its own areas;
- ``gather_all(rows, src, parts, shift, parity, graphs)``: both at once, for every destination (a
  cached dispatch's, whose own rows' place is known before the send);
- ``copy(dest, rows, area, row0)``: contiguous ``rows`` go there directly; ``copy_all(copies)``
  several such at once; ``sent(dest, phase)`` marks them;
- ``start_to_host(words)`` / ``wait_host(timeout_s)``: a small device vector on the host (the
  dispatch's one wait for the device), with work queued in between;
- ``start_round(op, round_)``: round ``round_`` of ``op`` starts on the caller's stream;
- ``gate(op, round_, sm)``: later writes of that round into the peers wait until the peers
  freed the areas they land in (ep.wire.flags, Note [Arrival flags]; the host protocol of ep.protocol.rounds
  orders host copies, so the ``HostMover`` needs nothing);
- ``check()``: raise the failure of an earlier call's arrival (never blocks);
- ``host_ordered``: whether the host meets of ep.protocol.rounds order the bytes (``HostMover``), or
  arrival flags do on the device (``CudaMover``: a call returns at launch);
- ``send_done()``: the end of a send phase on the caller's stream (what the receive work follows);
- ``arrived(sources, phase, then, writes, early)``: run ``then`` (the receive work:
  the unpack, the combine's sum) once the marks of ``sources`` toward this rank are complete
  (and each ``(phase, work)`` of ``early`` once that phase's marks are: the combine's parts),
  then order the caller's stream after it and after this rank's own pushes (the ``HostMover``
  runs the work at once: the host protocol waited for the bytes);
- ``combine_counts(counts, parity, timeout_s)``: a combine's per-rank row counts where its sum
  can read them (ep.kernels.reduce, Note [Pipelined combine]).

``phase`` names the marks of one phase and parity (``"dispatch.0"``, ...; ep.wire.regions, Note [Two
parities]).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from warmlink.ep.kernels import steps
from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.wire.regions import RegionLayout

__all__ = ["STAGE", "Gathers", "HostMover", "Views", "as_words"]


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``[N, words]`` view of a row-major tensor's bytes: int64 words when a row's size allows,
    else bytes (``view(N, -1)`` alone fails when N == 0)."""
    if t.dim() == 2 and t.shape[1] * t.element_size() % 8 == 0:  # every dispatch's x: one view
        return t if t.dtype == torch.int64 else t.view(torch.int64)
    row_nbytes = math.prod(t.shape[1:]) * t.element_size()
    flat = t.view(t.shape[0], math.prod(t.shape[1:]))
    word = torch.int64 if row_nbytes % 8 == 0 else torch.uint8
    return flat.view(torch.uint8).view(word) if t.dtype != word else flat


class Views:
    """Typed views of one region's areas, made once per (rank, area, word type, columns)."""

    def __init__(self, layout: RegionLayout, regions: dict[int, torch.Tensor]) -> None:
        self.layout = layout
        self.regions = regions
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, rank: int, area: str, dtype: torch.dtype, cols: int) -> torch.Tensor:
        key = (rank, area, dtype, cols)
        view = self._cache.get(key)
        if view is None:
            view = self._cache[key] = self.layout.view(self.regions[rank], area, dtype, cols)
        return view

    def parts(self, rank: int, src: Sources, parts: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x rows as int64 words, meta rows as bytes or None)`` of ``rank``'s areas ``parts``."""
        x = self.get(rank, parts[0], torch.int64, src.x.shape[1])
        meta = self.get(rank, parts[1], torch.uint8, self.layout.meta_bytes) if src.has_meta else None
        return x, meta


STAGE = ("stage_x", "stage_meta")


class Gathers:
    """The gathers both movers share: into this rank's staging slots, or into its own areas."""

    layout: RegionLayout
    rank: int
    _views: Views

    def _stage(self, rows: torch.Tensor, src: Sources, dests: range, skip: int) -> None:
        x, meta = self._views.parts(self.rank, src, STAGE)
        steps.gather(rows, src, x, meta, self.layout.num_topk, dests, skip=skip)

    def own_view(self, area: str, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """``[rows, cols]`` view of this rank's ``area`` as ``dtype``, made once per key."""
        return self._views.get(self.rank, area, dtype, cols)

    def place_local(self, rows: torch.Tensor, src: Sources, parts: tuple[str, ...], shift: int) -> None:
        x, meta = self._views.parts(self.rank, src, parts)
        steps.gather(rows, src, x, meta, self.layout.num_topk, range(self.rank, self.rank + 1), shift)

    def gather_all(self, rows: torch.Tensor, src: Sources, parts: tuple[str, ...], shift: int, parity: int,
                   timeout_s: float, graphs: bool = True) -> None:
        self.gather(rows, src, range(self.layout.num_ranks), self.rank)
        self.place_local(rows, src, parts, shift)


class HostMover(Gathers):
    """Shared-memory regions written directly by this process's CPU (the shm backend)."""

    host_ordered = True

    def __init__(self, layout: RegionLayout, rank: int, own: torch.Tensor, peers: dict[int, torch.Tensor]) -> None:
        self.layout = layout
        self.rank = rank
        self._views = Views(layout, {rank: own, **peers})
        self._words: torch.Tensor | None = None

    def begin(self, copies: bool = True) -> None:
        pass

    def gather(self, rows: torch.Tensor, src: Sources, dests: range, skip: int) -> None:
        self._stage(rows, src, dests, skip)

    def flush(self, dest: int, phase: str, src: Sources, row0: int, count: int, parts: tuple[str, ...]) -> None:
        if dest == self.rank or not count:
            return
        slot = dest * self.layout.max_tokens
        for staged, there in zip(self._views.parts(self.rank, src, STAGE), self._views.parts(dest, src, parts)):
            if staged is not None:
                there[row0:row0 + count].copy_(staged[slot:slot + count])

    def copy(self, dest: int, rows: torch.Tensor, area: str, row0: int) -> None:
        words = as_words(rows)
        self._views.get(dest, area, words.dtype, words.shape[1])[row0:row0 + words.shape[0]].copy_(words)

    def flush_all(self, phase: str, src: Sources, parts: tuple[str, ...], plan) -> None:
        for dest, row0, count in plan:
            self.flush(dest, phase, src, row0, count, parts)

    def copy_all(self, copies) -> None:
        for copy in copies:
            self.copy(*copy)

    def sent(self, dest: int, phase: str) -> None:
        pass

    def start_to_host(self, words: torch.Tensor) -> None:
        self._words = words

    def wait_host(self, timeout_s: float) -> np.ndarray:
        words, self._words = self._words, None
        return words.numpy().copy()

    def start_round(self, op: str, round_: int) -> None:
        pass

    def gate(self, op: str, round_: int, sm: bool) -> None:
        pass

    def check(self) -> None:
        pass

    def send_done(self) -> None:
        pass

    def arrived(self, sources, phase: str, then=None, writes=(), early=()) -> None:
        for _, work in early:  # the mailbox's "sent" round already ordered the copies
            work()
        if then is not None:
            then()

    def combine_counts(self, counts: list[int], parity: int, timeout_s: float) -> torch.Tensor:
        return torch.tensor(counts, dtype=torch.int64, device="cpu")

    def close(self) -> None:
        self._views = None
