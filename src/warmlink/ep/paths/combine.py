"""A combine's send phase and receive work, in parts (ep.kernels.reduce, Note [Pipelined combine]).

The round protocol around them (publish, meet, "sent") is ``Buffer.combine``'s (ep.protocol.rounds).
"""

from __future__ import annotations

import time

import torch

from warmlink.ep.kernels.reduce import combine_sum, part_bounds, part_phase, part_sums
from warmlink.ep.paths.host_mover import as_words
from warmlink.ep.wire.handle import Handle
from warmlink.ep.wire.regions import PARITIES, RegionLayout, area

__all__ = ["Combiner"]


class Combiner:
    """Sends a combine's rows back to their sources in ``parts`` parts, and sums them part by part.

    Args:
        mover: the Buffer's mover. layout: the group's region layout. rank: this rank.
        order: the peers in the order this rank sends to them (ep.protocol.rounds, ``Rounds.order``).
        parts: the parts of every combine (every rank must use the same).
        timeout_s: the limit of the wait for the counts' pinned row (``mover.combine_counts``).
    """

    def __init__(self, mover, layout: RegionLayout, rank: int, order: list[int], parts: int, timeout_s: float) -> None:
        self.mover, self.layout, self.rank, self.order = mover, layout, rank, order
        self.parts, self.timeout_s = parts, timeout_s

    def send(self, handle: Handle, rows: torch.Tensor, weights: torch.Tensor | None, round_: int) -> torch.Tensor:
        """Issue every peer's rows of ``rows`` (and ``weights``, with the last part) into its combine
        area and mark each part sent; the per-rank counts the sum reads (``mover.combine_counts``)."""
        mover, parity, order = self.mover, round_ % PARITIES, self.order
        # the rows each rank sends back, for the sum's parts (Note [Pipelined combine]); before begin
        counts = mover.combine_counts(handle.send_counts, parity, self.timeout_s)
        mover.begin()
        mover.gate("combine", round_, sm=False)  # the peers' sums of round n - 2 read these areas
        comb_x, comb_w = area("comb_x", round_), area("comb_w", round_)
        slot = self.rank * self.layout.max_tokens
        parts, words = self.parts, as_words(rows)  # one view for every part's copy
        bounds = [part_bounds(handle.recv_counts[s], parts) for s in order]
        for k in range(parts):  # part-major: one copy stream serving every peer pipelines too
            copies = [(s, words[handle.recv_starts[s] + b[k]:handle.recv_starts[s] + b[k + 1]], comb_x, slot + b[k])
                      for s, b in zip(order, bounds)]
            if k == parts - 1 and weights is not None:
                copies += [(s, weights[handle.recv_starts[s]:handle.recv_starts[s] + b[-1]], comb_w, slot)
                           for s, b in zip(order, bounds)]
            mover.copy_all(copies)
            for s in order:
                mover.sent(s, part_phase(k, parity, parts))
        mover.sent(self.rank, f"combine.{parity}")  # nothing to copy: this rank's own rows are summed where they lie
        mover.send_done()
        return counts

    def receive(self, handle: Handle, rows: torch.Tensor, weights: torch.Tensor | None, round_: int,
                counts: torch.Tensor, out: torch.Tensor, out_w: torch.Tensor | None, arrived) -> float:
        """Sum every token's copies into ``out`` (and ``out_w``), each part behind its bytes, through
        ``arrived(phase, then, writes, early)``; the host clock when the last sum was queued."""
        parity, parts, hidden = round_ % PARITIES, self.parts, self.layout.hidden
        comb_x, comb_w = area("comb_x", round_), area("comb_w", round_)
        # this rank's own copy of token t is row combine_rows[t, me] - me * max_tokens + recv_starts[me] of x
        shift = handle.recv_starts[self.rank] - self.rank * self.layout.max_tokens
        sums = part_sums(self.mover.own_view(comb_x, rows.dtype, hidden), handle.combine_rows, out,
                         local=(rows, self.rank, shift), counts=counts, slot_rows=self.layout.max_tokens, parts=parts)
        queued = []

        def last() -> None:
            sums[-1]()
            if out_w is not None:  # the weights came with the last part
                combine_sum(self.mover.own_view(comb_w, torch.float32, out_w.shape[1]),
                            handle.combine_rows, out_w, local=(weights, self.rank, shift))
            queued.append(time.perf_counter())

        # rows/weights stay referenced until this returns
        early = [(part_phase(k, parity, parts), sums[k]) for k in range(parts - 1)]
        arrived(f"combine.{parity}", last, (out, out_w), early)
        return queued[0]
