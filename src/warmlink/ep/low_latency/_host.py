"""The host data path of low-latency mode: this process's CPU writes rows straight into its peers'
shared-memory regions (the shm backend, and CI). See Note [Low-latency layout].

The same four steps the device path (ep.low_latency._device) runs as kernels writing peers'
IPC-mapped memory:

- ``send_dispatch``: cast (FP8 on request), then each row into slot ``(e, this rank)`` of its
  expert's rank, in token order, then the slots' signal words;
- ``arrived_counts`` and ``receive_dispatch``: read the signal words of every source, then pack
  its slots into the outputs, expert by expert;
- ``send_combine``: each received row back to its source, at row ``t * K + k``;
- ``receive_combine``: the weighted sum of each token's rows, skipping ``-1`` entries.
"""

from __future__ import annotations

import numpy as np
import torch

from warmlink.ep.low_latency._cast import cast_fp8, pack_ue8m0
from warmlink.ep.low_latency._layout import LL_PARITIES, LowLatencyLayout
from warmlink.ep.low_latency._outputs import ParityViews
from warmlink.errors import MetadataError

__all__ = ["HostPath"]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, a + n) for a, n in zip(starts, lengths)])`` without the loop."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    shift = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return shift + np.arange(total, dtype=np.int64)


class HostPath:
    """Row moves of one rank over host memory.

    Args:
        layout: the group's low-latency layout.
        rank: this rank.
        regions: ``{rank: flat uint8 tensor}`` of every rank's region as mapped here (this one's too).
    """

    def __init__(self, layout: LowLatencyLayout, rank: int, regions: dict[int, torch.Tensor]) -> None:
        self.layout = layout
        self.rank = rank
        # rows move as int64 words (a row is 2H bytes, H a multiple of 128): byte-wise index copies
        # run several times slower on the host
        words = layout.row_bytes // 8
        self._disp = {(r, p): layout.view(t, "disp", p, torch.int64, words) for r, t in regions.items()
                      for p in range(LL_PARITIES)}
        self._meta = {(r, p): layout.view(t, "disp_meta", p, torch.int64, 1).view(-1) for r, t in regions.items()
                      for p in range(LL_PARITIES)}
        self._signal = {(r, p): layout.view(t, "signal", p, torch.int64, layout.num_ranks) for r, t in regions.items()
                        for p in range(LL_PARITIES)}
        self._comb = {(r, p): layout.view(t, "comb", p, torch.int64, words) for r, t in regions.items()
                      for p in range(LL_PARITIES)}
        self._regions = regions
        self._stage = torch.empty(layout.max_tokens, layout.row_bytes, dtype=torch.uint8, device="cpu")  # one call's rows, cast
        self._order = [(rank + i) % layout.num_ranks for i in range(layout.num_ranks)]  # ranks start on different peers

    def send_dispatch(self, round_: int, x: torch.Tensor, topk_idx: torch.Tensor, tokens: int, fp8: bool,
                      round_scale: bool, masked: set[int] = frozenset()) -> None:
        """Write every (token, expert) row of ``x`` into its expert's rank, then the signal words of
        round ``round_``, except to the ``masked`` ranks (ep.low_latency._mask). ``tokens`` is the
        call's ``num_max_dispatch_tokens_per_rank``."""
        lay, p = self.layout, round_ % LL_PARITIES
        n, num_cols = topk_idx.shape
        hidden, stage = lay.hidden, self._stage[:n]
        if fp8 and n:  # (no tokens: an empty [0, 1] of scales can have stride 0, which no byte view takes)
            q, scales = cast_fp8(x, round_scale)
            stage[:, :hidden].copy_(q.view(torch.uint8))
            stage[:, hidden:hidden + 4 * lay.num_scales].copy_(scales.view(torch.uint8))
        elif not fp8:
            stage.copy_(x.view(torch.uint8))
        flat = topk_idx.reshape(-1).long()
        entries = (flat >= 0).nonzero().squeeze(1)
        experts, order = torch.sort(flat[entries], stable=True)  # by expert (so by rank), tokens in order
        entries = entries[order]
        counts = torch.bincount(experts, minlength=lay.num_experts)
        slot = torch.arange(experts.numel(), device=experts.device) - (counts.cumsum(0) - counts)[experts]
        token = entries // num_cols
        rows = ((experts % lay.local_experts) * lay.num_ranks + self.rank) * tokens + slot
        meta = token * lay.num_topk + entries % num_cols
        per_dest = counts.view(lay.num_ranks, lay.local_experts)
        signals = per_dest | round_ << 32
        bounds = [0, *per_dest.sum(1).cumsum(0).tolist()]
        for d in self._order:
            if d in masked:
                continue
            a, b = bounds[d], bounds[d + 1]
            if a < b:
                self._disp[d, p].index_copy_(0, rows[a:b], stage.view(torch.int64).index_select(0, token[a:b]))
                self._meta[d, p].index_copy_(0, rows[a:b], meta[a:b])
            self._signal[d, p][:, self.rank] = signals[d]  # after the rows (x86 keeps stores in order)

    def arrived_counts(self, round_: int, live: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[R, L]``: rows each source wrote into this rank's slots in round ``round_``; 0
        for a source not ``live`` (bool ``[R]``, default all: masked, ep.low_latency._mask), whatever it wrote.

        Raises:
            MetadataError: a signal word of another round (a source published the round in its
                mailbox before its counts, or wrote outside its slots).
        """
        words = self._signal[self.rank, round_ % LL_PARITIES].numpy().T.copy()
        if live is not None:
            words[~live] = round_ << 32
        tags = words >> 32
        if (tags != round_).any():
            s, e = (int(v[0]) for v in np.nonzero(tags != round_))
            raise MetadataError(f"ep low-latency dispatch round {round_}: rank {s}'s signal word for local expert {e} "
                                f"holds round {int(tags[s, e])}; expected {round_}")
        return words & 0xFFFFFFFF

    def receive_dispatch(self, p: int, counts: np.ndarray, tokens: int, fp8: bool, ue8m0: bool,
                         out: ParityViews) -> list[torch.Tensor]:
        """Pack the rows ``counts[s, e]`` (int64 ``[R, L]``) of every source into ``out``; returns,
        per source, the flat rows of ``[L * R * tokens]`` that came from it (what combine sends back)."""
        lay = self.layout
        num_ranks, num_local, hidden = lay.num_ranks, lay.local_experts, lay.hidden
        per_expert = num_ranks * tokens
        begins = counts.cumsum(0) - counts  # [R, L]: where source s starts in expert e's block
        totals = counts.sum(0)
        out.count.copy_(torch.from_numpy(totals.astype(np.int32)))
        out.layout_range.copy_(torch.from_numpy((begins.T << 32) | counts.T))
        # slots in expert-major, source-minor order: expert e's rows land at [0, totals[e]) of block e
        slot_starts = (np.arange(num_local)[:, None] * num_ranks + np.arange(num_ranks)[None, :]) * tokens
        src = torch.from_numpy(_ranges(slot_starts.reshape(-1), counts.T.reshape(-1)))
        expert_of = torch.from_numpy(np.repeat(np.arange(num_local), totals))
        within = torch.from_numpy(_ranges(np.zeros(num_local, dtype=np.int64), totals))
        dst = expert_of * per_expert + within
        rows = self._disp[self.rank, p].index_select(0, src)
        x_words = out.x.view(num_local * per_expert, hidden).view(torch.int64)
        x_words.index_copy_(0, dst, rows[:, :x_words.shape[1]])
        if fp8:
            scales = rows.view(torch.uint8)[:, hidden:hidden + 4 * lay.num_scales].contiguous().view(torch.float32)
            out.scales.index_put_((expert_of, within), pack_ue8m0(scales) if ue8m0 else scales)
        meta = self._meta[self.rank, p].index_select(0, src)
        out.src_info.view(-1).index_copy_(0, dst, (meta // lay.num_topk).int())
        out.comb_slot.view(-1).index_copy_(0, dst, meta)
        return [torch.from_numpy(_ranges(np.arange(num_local) * per_expert + begins[s], counts[s]))
                for s in range(num_ranks)]

    def send_combine(self, p: int, x: torch.Tensor, rows_by_source: list[torch.Tensor], comb_slot: torch.Tensor,
                     masked: set[int] = frozenset()) -> None:
        """Each received row of ``x`` (``[L, R*Tc, H]``) back to its source, at its ``t * K + k`` row,
        except to the ``masked`` ranks."""
        flat, slots = x.view(-1, self.layout.hidden).view(torch.int64), comb_slot.reshape(-1)
        for s in self._order:
            rows = rows_by_source[s]
            if rows.numel() and s not in masked:
                self._comb[s, p].index_copy_(0, slots.index_select(0, rows), flat.index_select(0, rows))

    def receive_combine(self, p: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
                        live: np.ndarray | None = None) -> None:
        """``out[t] = sum_k topk_weights[t, k] * row(t, k)`` over ``topk_idx[t, k] >= 0`` whose expert's
        rank is ``live`` (bool ``[R]``, default all) (float32, then BF16)."""
        lay = self.layout
        n, num_cols = topk_idx.shape
        comb = self._comb[self.rank, p][:n * lay.num_topk].view(torch.bfloat16).view(n, lay.num_topk, lay.hidden)
        valid = topk_idx >= 0
        if live is not None and not live.all():
            valid &= torch.from_numpy(live)[(topk_idx.long() // lay.local_experts).clamp(min=0)]
        acc = torch.zeros(n, lay.hidden, dtype=torch.float32, device=comb.device)
        for k in range(num_cols):  # in column order, so every rerun sums alike
            # where, not a multiply by 0: a slot no rank wrote this round may hold any bits, NaN included
            acc += torch.where(valid[:, k:k + 1], comb[:, k].float() * topk_weights[:, k:k + 1], 0.0)
        out.copy_(acc)

    def zero(self) -> None:
        """Zero this rank's region (every area of both parities)."""
        self._regions[self.rank].zero_()

    def close(self) -> None:
        self._disp = self._meta = self._comb = self._regions = {}
