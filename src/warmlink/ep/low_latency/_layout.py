"""The byte layout of one rank's low-latency region and the outputs it fills, the same in every rank.

# Note [Low-latency layout]
Decode batches are small (at most ``T = num_max_dispatch_tokens_per_rank`` tokens per rank), their
shapes are fixed, and a call must not wait for its peers before it sends: there is no count
exchange. So every place a row can land is reserved up front, and a sender alone knows where each
of its rows goes.

Dispatch. Rank ``d`` holds, per parity ``p`` (round ``n`` uses ``p = n % 2``, as in
ep.wire.regions Note [Two parities]), a slot of ``T`` rows per (local expert ``e``, source ``s``):

    disp.p       [L, R, T] rows of 2H bytes: BF16 x, or FP8 x (H bytes) then its H/128 float32 scales
    disp_meta.p  [L, R, T] int64: the row's source token and top-k column, ``t * K + k``
    signal.p     [L, R] int64: ``round << 32 | count`` of slot ``(e, s)``, written by ``s``

with ``L = E / R`` local experts and ``K`` the Buffer's ``num_topk``. Source ``s`` writes its
``c[e]`` rows for expert ``e`` into slot ``(e, s)`` in token order, then the slot's signal word
(every slot of every rank, empty ones too), then "round n" in its mailbox (ep.wire.mailbox, Note
[Mailbox rounds]); the round in each word proves the counts are this round's. The device path
(Note [Low-latency device path]) polls the signal words instead of the mailbox, its sequence
number in their high half, so the layout is the same for both. The receiver
packs slot ``(e, 0)``, then ``(e, 1)``, ... into output row block ``e``: DeepEP's layout,
``[L, R * T, H]`` with ``recv_count[e]`` valid rows, in a deterministic order (by source rank,
then source token) where DeepEP's depends on which warp came first.

Combine. Source ``s`` holds, per parity, one row per (token, top-k column):

    comb.p       [T, K] rows of 2H bytes (BF16), written by the rank of expert ``topk_idx[t, k]``
    words.p      [2R + E] int64: the device path's combine signal word of each expert rank, its
                 "received" (ack) word of each rank's combine, and of each (rank, local expert)'s
                 dispatch (Note [Low-latency device path])

Each (t, k) has one writer, so nothing is summed on the wire; ``s`` sums the rows of its valid
(t, k) with its weights once every rank published the round. DeepEP reserves a row per (expert,
token) instead, ``E / K`` times more.

Outputs (``recv_x``, scales, ``recv_count`` and the handle's tensors) are allocated once per
parity at construction, as DeepEP's double buffer: a call's outputs stay valid until the call two
rounds later.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from warmlink.ep.wire.fp8 import FP8_BLOCK
from warmlink.ep.wire.regions import MAX_EXPERTS, check_positive
from warmlink.errors import ConfigError

__all__ = ["LL_PARITIES", "LowLatencyLayout"]

LL_PARITIES = 2
_ALIGN = 256
_AREAS = ("disp", "disp_meta", "signal", "comb", "words")
_UE8M0_PACK = 4  # UE8M0 exponents per int32, as DeepEP packs them


@dataclass(frozen=True)
class LowLatencyLayout:
    """Sizes of one rank's low-latency region and outputs (See Note [Low-latency layout]).

    Args:
        num_ranks: R. max_tokens: T, the most tokens a rank dispatches per call.
        hidden: H, a multiple of 128. num_experts: E, a multiple of R. num_topk: K, the most
            experts per token.
    """

    num_ranks: int
    max_tokens: int
    hidden: int
    num_experts: int
    num_topk: int

    def __post_init__(self) -> None:
        for name in ("num_ranks", "max_tokens", "hidden", "num_experts", "num_topk"):
            check_positive(name, getattr(self, name), "ep low-latency")
        if self.hidden % FP8_BLOCK:
            raise ConfigError(f"ep low-latency: hidden={self.hidden}; expected a multiple of {FP8_BLOCK} "
                              "(FP8 scales are per 128 channels)")
        if self.num_experts % self.num_ranks or self.num_experts > MAX_EXPERTS:
            raise ConfigError(f"ep low-latency: num_experts={self.num_experts}; expected a multiple of "
                              f"num_ranks={self.num_ranks}, at most {MAX_EXPERTS}")

    def config(self) -> dict[str, int]:
        """What every rank of a group must share (its rank info's ``config``)."""
        return {"num_ranks": self.num_ranks, "max_tokens": self.max_tokens, "hidden": self.hidden,
                "num_experts": self.num_experts, "num_topk": self.num_topk}

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def slots(self) -> int:
        """Rows of a dispatch area: ``L * R * T`` (= ``E * T``)."""
        return self.num_experts * self.max_tokens

    @property
    def row_bytes(self) -> int:
        """Bytes of a dispatch or combine row: a BF16 token (an FP8 token and its scales fit in it)."""
        return 2 * self.hidden

    @property
    def num_scales(self) -> int:
        return self.hidden // FP8_BLOCK

    @property
    def num_packed_scales(self) -> int:
        """int32 columns of UE8M0 scales: four exponents each, the last padded with zeros."""
        return -(-self.num_scales // _UE8M0_PACK)

    def area_bytes(self, kind: str) -> int:
        return {"disp": self.slots * self.row_bytes, "disp_meta": self.slots * 8, "signal": self.num_experts * 8,
                "comb": self.max_tokens * self.num_topk * self.row_bytes,
                "words": (2 * self.num_ranks + self.num_experts) * 8}[kind]

    @functools.cached_property
    def _offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for p in range(LL_PARITIES):
            for kind in _AREAS:
                out[f"{kind}.{p}"] = at
                at += -(-self.area_bytes(kind) // _ALIGN) * _ALIGN
        out["end"] = at
        return out

    def offset(self, area: str) -> int:
        return self._offsets[area]

    @property
    def region_nbytes(self) -> int:
        """Bytes of the region peers write into (shared memory, or device memory mapped by peers)."""
        return self._offsets["end"]

    @property
    def output_nbytes(self) -> int:
        """Bytes of the outputs this rank fills (local memory, both parities): received x, float32
        and UE8M0 scales, the handle's source info, combine slots and ranges, counts, and the
        dispatch's top-k mask."""
        rows = self.slots
        per_parity = (rows * (self.row_bytes + 4 * self.num_scales + 4 * self.num_packed_scales + 4 + 8)
                      + self.num_experts * 8 + self.local_experts * 4 + self.max_tokens * self.num_topk)
        return LL_PARITIES * per_parity

    @property
    def combine_buffer_nbytes(self) -> int:
        """Bytes of the zero-copy combine buffers (both parities: BF16 ``[L, R*T, H]`` each), made by
        the first ``get_next_low_latency_combine_buffer``."""
        return LL_PARITIES * self.slots * self.hidden * 2

    def view(self, region, area: str, p: int, dtype, cols: int):
        """``[rows, cols]`` view of ``area`` (``"disp"``, ``"disp_meta"``, ``"signal"``, ``"comb"``) of parity ``p``
        in a flat ``uint8`` region tensor."""
        start, nbytes = self.offset(f"{area}.{p}"), self.area_bytes(area)
        flat = region[start:start + nbytes].view(dtype)
        return flat.view(-1, cols)


def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
              num_topk: int = 8) -> int:
    """Bytes one rank's low-latency mode holds: its region, its outputs and its zero-copy combine
    buffers (both parities of each; the last made on first use).

    See ``Buffer.get_low_latency_rdma_size_hint``.
    """
    lay = LowLatencyLayout(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk)
    return lay.region_nbytes + lay.output_nbytes + lay.combine_buffer_nbytes
