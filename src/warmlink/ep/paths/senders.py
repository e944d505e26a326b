"""How a dispatch's rows reach their destinations: one data path per Buffer, chosen once.

- ``HostPath`` (``send="host"``, the shm backend): the CPU stages the rows and, once the ranks
  met, copies them into the peers' shared memory;
- ``CopyEnginePath`` (``send="copy"``, cuda_ipc): the same steps, the rows gathered by one
  kernel and moved by the copy engines (ep.paths.cuda_mover, Note [Copy-engine sends]);
- ``SmPath`` (``send="sm"``, cuda_ipc, the default there): kernels trade the counts and store
  the rows into the peers (ep.paths.sm_pushes, Note [SM sends]). A call with a receive hook still
  goes through the copy engines: a push kernel would hold SMs between the send and the hook;
- ``StreamPath`` (``send="stream"``, cuda_ipc; ep.paths.streamed): the rows stream through a
  fixed space with credits the GPUs check (Note [Streamed dispatch] in ep.kernels.stream), its
  protocol ep.protocol.streamed's.

A path only moves bytes. When it moves them, and what the ranks agree on first, is the round's
(ep.protocol.normal, ``NormalMode``): for a staged path the counts reach the host and the ranks
meet before ``send_planned``; for the SM path the device trades the counts itself (``launch``)
and the host reads them after (``wait_board``).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from warmlink.ep.kernels.call_block import FreshShape, Sources, call_words
from warmlink.ep.kernels.steps import plan
from warmlink.ep.wire.handle import Handle
from warmlink.ep.wire.words import REFUSED
from warmlink.ep.wire.regions import PARITIES, RegionLayout

__all__ = ["PATHS", "CopyEnginePath", "FreshSend", "HostPath", "SmPath", "StagedPath", "fresh_shape", "refused_send"]

_SERIALS = itertools.count()  # one per path: keys what a handle caches about a Buffer's mappings


class FreshSend(NamedTuple):
    """A fresh dispatch, checked: its rows, routing and config word, and its round's names."""

    src: Sources
    in_rank: torch.Tensor
    per_rank: torch.Tensor
    per_expert: torch.Tensor
    num_experts: int
    config: int  # ep.wire.words.encode_call
    num_worst_tokens: int
    round: int
    phase: str  # the round's event phase: "dispatch.<parity>"
    parts: tuple[str, str]  # the receive areas of the round's parity: x, meta
    refused: str | None = None  # why this rank refused its arguments: it sends no tokens (Note [Refused dispatch])
    kind: int = 0  # the compiled argument check's kind of call (ep.protocol.checks), 0 where the Python checks ran


def refused_send(reason: str, num_ranks: int, hidden: int, device: torch.device, round_: int = 0,
                 phase: str = "dispatch", parts: tuple[str, str] = ("", "")) -> FreshSend:
    """A fresh dispatch of no tokens, refused for ``reason``: its count per rank (-1) matches no row,
    so the device refuses the round on every rank (ep.protocol.normal, Note [Refused dispatch])."""
    src = Sources(torch.empty(0, hidden // 4, dtype=torch.int64, device=device),
                  torch.empty(0, 1, dtype=torch.int64, device=device))
    return FreshSend(src, torch.empty(0, num_ranks, dtype=torch.bool, device=device),
                     torch.full((num_ranks,), -1, dtype=torch.int32, device=device),
                     torch.zeros(num_ranks, dtype=torch.int32, device=device), num_ranks, REFUSED, 0, round_, phase,
                     parts, refused=reason)


class StagedPath:
    """Staged copies: gather, (the ranks meet), copy (Note [Copy-engine sends] in
    ep.paths.cuda_mover), through ``mover``: a ``HostMover`` or a ``CudaMover``."""

    name = "staged"

    def __init__(self, mover, layout: RegionLayout, rank: int, num_ranks: int, graphs: bool) -> None:
        self.mover, self.layout = mover, layout
        self.rank, self.num_ranks = rank, num_ranks
        self.graphs = graphs  # replay the cached gather's push (ep.paths.sm_pushes, Note [Fresh send graph])
        self.serial = next(_SERIALS)

    def by_sm(self, hook: bool) -> bool:
        """Whether a fresh dispatch with (or without) a receive hook moves its rows by SMs."""
        return False

    def stage(self, call: FreshSend) -> torch.Tensor:
        """Plan ``call`` (its ``rows``: every token's row in every destination's slot), start its
        words' copy to the host, and gather the peers' rows into staging meanwhile: that needs
        only this rank's own plan (Note [Copy-engine sends])."""
        rows, words = plan(call.in_rank, call.src.topk, call.per_rank, call.per_expert, self.layout.max_tokens)
        self.mover.start_to_host(words)
        self.mover.begin()
        self.mover.gather(rows, call.src, range(self.num_ranks), self.rank)
        return rows

    def planned_words(self, timeout_s: float) -> np.ndarray:
        """``stage``'s plan words on the host (ep.kernels.steps ``words_layout``)."""
        return self.mover.wait_host(timeout_s)

    def send_planned(self, handle: Handle, call: FreshSend, order: list[int]) -> None:
        """Issue every staged row where ``handle``'s completed plan says: the peers in ``order``,
        then this rank's own rows."""
        mover, me = self.mover, self.rank
        mover.flush_all(call.phase, call.src, call.parts, [(d, handle.dst_rows[d], handle.send_counts[d]) for d in order])
        mover.place_local(handle.combine_rows, call.src, call.parts, handle.dst_rows[me] - me * self.layout.max_tokens)
        mover.flush(me, call.phase, call.src, 0, 0, call.parts)

    def send_cached(self, handle: Handle, src: Sources, round_: int, phase: str, parts: tuple[str, str],
                    order: list[int], hook: bool, timeout_s: float) -> None:
        """Issue every row where ``handle`` says, with no wait for the peers. One gather for every
        destination, this rank's own rows included, then the copies: a launch per peer cost a slow
        rank's host up to 0.15 ms more before its last copy, and every peer waits for that copy."""
        mover, me = self.mover, self.rank
        mover.begin(copies=False)  # the copies wait for the gather, which follows the start
        mover.gather_all(handle.combine_rows, src, parts, handle.dst_rows[me] - me * self.layout.max_tokens,
                         round_ % PARITIES, timeout_s, self.graphs)
        mover.gate("dispatch", round_, sm=False)  # no peer meets a cached dispatch: Note [Arrival flags] in ep.wire.flags
        mover.flush_all(phase, src, parts, [(d, handle.dst_rows[d], handle.send_counts[d]) for d in (*order, me)])


class HostPath(StagedPath):
    """``StagedPath``'s steps by the CPU, over shared memory (``mover`` is a ``HostMover``)."""

    name = "host"


class CopyEnginePath(StagedPath):
    """``StagedPath``'s steps on CUDA: one gather kernel, then the copy engines move the bytes
    (``mover`` is a ``CudaMover``)."""

    name = "copy"


class SmPath(CopyEnginePath):
    """Kernels trade the counts and store every row (ep.paths.sm_pushes, Note [SM sends]); with a
    receive hook, ``CopyEnginePath``'s steps."""

    name = "sm"

    def by_sm(self, hook: bool) -> bool:
        return not hook

    def launch(self, call: FreshSend, rows: torch.Tensor, board: torch.Tensor | None, timeout_s: float) -> None:
        """The plan, count exchange and push of ``call`` on the caller's stream (``rows``: the
        handle's, filled by the plan; ``board``: where the count board is copied for a padded
        call, Note [Padded dispatch returns at launch] in ep.protocol.normal)."""
        src = call.src
        words = call_words(call.in_rank, src.topk, call.per_rank, call.per_expert, rows, src, call.round, call.config)
        self.mover.send_sm(fresh_shape(self.layout, self.num_ranks, call), words, call.round, call.phase, timeout_s,
                           self.graphs, board_copy=board)

    def board_like(self) -> torch.Tensor:
        return self.mover.board_like()

    def wait_board(self, round_: int, timeout_s: float, check) -> tuple[np.ndarray, np.ndarray]:
        """``(plan words, count board)`` of ``round_``'s exchange on the host (``check``: called
        while waiting, raises what stops the wait)."""
        return self.mover.wait_board(round_, timeout_s, check)

    def abort(self, round_: int) -> None:
        """End ``round_``'s count exchange on the device without waiting for it."""
        self.mover.abort_exchange(round_)

    def send_cached(self, handle: Handle, src: Sources, round_: int, phase: str, parts: tuple[str, str],
                    order: list[int], hook: bool, timeout_s: float) -> None:
        """One push kernel at bases made once per handle, parity and row size."""
        if hook:
            super().send_cached(handle, src, round_, phase, parts, order, hook, timeout_s)
            return
        mover = self.mover
        mover.begin(copies=False)  # the SMs push
        mover.gate("dispatch", round_, sm=True)
        key = (self.serial, round_ % PARITIES, src.x.shape[1])  # addresses of this Buffer's mappings
        bases = handle.sm_bases.get(key)
        if bases is None:
            bases = handle.sm_bases[key] = mover.sm_bases(handle.dst_rows, key[1], src.x.shape[1] * src.x.element_size())
        mover.send_sm_cached(handle.combine_rows, src, bases, key[1], phase, timeout_s, self.graphs)


def fresh_shape(layout: RegionLayout, num_ranks: int, call: FreshSend) -> FreshShape:
    """What a fresh send's kernels are specialized for (its graphs' key, with the parity)."""
    src = call.src
    return FreshShape(num_ranks, call.num_experts, src.topk.shape[1], src.x.shape[1],
                      src.scales.shape[1] if src.scales is not None else 0, layout.max_tokens, layout.num_topk,
                      layout.meta_bytes, src.topk.dtype, call.per_rank.dtype, call.per_expert.dtype,
                      src.weights.dtype if src.weights is not None else None)


PATHS = {"sm": SmPath, "copy": CopyEnginePath, "host": HostPath}  # by ep.api.options.SENDS
