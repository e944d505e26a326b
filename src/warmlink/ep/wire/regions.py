"""The byte layout of one rank's ep region, the same in every rank of a group.

One allocation per rank, leased from the pool and mapped once by every peer:

    recv_x.p, recv_meta.p dispatch receive area of parity p (0, 1): R * max_tokens rows, filled
                          by the sources in order (Note [Send order], ep.kernels.layout)
    comb_x.p, comb_w.p    combine receive area of parity p: one slot of max_tokens rows per
                          expert rank, slot d written only by rank d
    stage_x, stage_meta   send staging (local use): one slot of max_tokens rows per destination,
                          gathered by a kernel and pushed by the copy engines from there
    board.p               count board of parity p: one row per source rank, written by that
                          source's exchange kernel (ep.paths.sm_pushes, Note [SM sends])
    stream                a streamed Buffer's receive space (``stream_channels`` > 0: Note
                          [Streamed dispatch] in ep.kernels.stream): rings per source and channel,
                          whatever the batch; its slot areas above then hold no row

Round n of dispatch (and of combine) lands in parity ``n % 2``. See Note [Two parities].

A meta row carries a token's routing next to it: top-k ids (int64, columns ``[0, K)``), top-k
weights (float32 columns ``[2K, 3K)``) and FP8 scales (float32 columns ``[3K, 3K + H/128)``),
with K the buffer's ``num_topk``; one gather and one copy move all three.

Every receiving row count is bounded by construction (a source sends at most max_tokens rows to
each rank), so a peer can never write outside its slot or past the area.

# Note [Two parities]
A source may write round ``n`` into a peer as soon as it has its own plan, without waiting for
that peer to reach round ``n``: round ``n`` lands in parity ``n % 2``, whose last user was round
``n - 2``. On GPUs the writes of a cached dispatch or a combine wait on the device for each
peer's ``freed`` word (ep.wire.flags, Note [Arrival flags]), which that peer's stream stores once it
is done with round ``n - 2``'s area (a fresh dispatch's count exchange already waits for every
peer to reach round ``n``). With host copies the source's host finished round ``n - 1``, whose
receive waited for every peer's host to pass the start of round ``n - 1`` (ep.protocol.rounds, Note
[Round protocol], step 4). So the copies start right after the gathers, with no host waiting for
a peer. The price is twice the receive memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from warmlink.ep.kernels.stream import StreamSpace, row_words
from warmlink.ep.kernels.stream_combine import combine_row_words
from warmlink.ep.wire.fp8 import num_scales
from warmlink.errors import ConfigError

__all__ = ["AREAS", "MAX_EXPERTS", "PARITIES", "RegionLayout", "area", "check_positive", "size_hint"]

_ALIGN = 256
# x rows are sized for the widest token dtype (2 bytes).
PARITIES = 2
AREAS = tuple(f"{kind}.{p}" for kind in ("recv_x", "recv_meta", "comb_x", "comb_w") for p in range(PARITIES)) + (
    "stage_x", "stage_meta") + tuple(f"board.{p}" for p in range(PARITIES))
# the most experts a call may name (the mailbox's counts are sized for it too)
MAX_EXPERTS = 4096


def board_words(num_ranks: int) -> int:
    """int64 words of one board row: round tag, valid flag, the source's counts per destination,
    and its counts for each of the destination's experts (at most MAX_EXPERTS / num_ranks)."""
    return 2 + num_ranks + -(-MAX_EXPERTS // num_ranks)


def area(kind: str, round_: int) -> str:
    """The name of ``kind``'s area (``"recv_x"``, ``"recv_meta"``, ``"comb_x"``, ``"comb_w"``) for ``round_``."""
    return f"{kind}.{round_ % PARITIES}"


def check_positive(name: str, value, where: str = "ep") -> int:
    """``value`` if it is an int > 0, else ``ConfigError`` naming ``name`` (a layout's size)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: {name}={value!r}; expected an int > 0")
    return value


@dataclass(frozen=True)
class RegionLayout:
    """Offsets of every area for ``num_ranks`` ranks of ``max_tokens`` tokens of ``hidden`` channels
    with ``num_topk`` experts each; with ``stream_channels`` > 0, a stream space of that many
    channels and ``ring_rows`` rows a ring instead of the slot areas."""

    num_ranks: int
    max_tokens: int
    hidden: int
    num_topk: int
    stream_channels: int = 0
    ring_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("num_ranks", "max_tokens", "hidden", "num_topk"):
            check_positive(name, getattr(self, name))
        if self.hidden % 8:  # every send path moves rows as int64 words, FP8 rows (1 byte a channel) too
            raise ConfigError(f"ep: hidden={self.hidden}; expected a multiple of 8 (rows move as 8-byte words)")
        if self.stream_channels:
            check_positive("stream_channels", self.stream_channels)
            check_positive("ring_rows", self.ring_rows)
        elif self.ring_rows:
            raise ConfigError(f"ep: ring_rows={self.ring_rows} without stream_channels; expected both or neither")

    def config(self) -> dict[str, int]:
        """The sizes every rank of a group must share (the ``config`` of its rank info)."""
        return {"num_ranks": self.num_ranks, "max_tokens": self.max_tokens, "hidden": self.hidden,
                "num_topk": self.num_topk, "stream_channels": self.stream_channels, "ring_rows": self.ring_rows}

    @property
    def rows(self) -> int:
        """Rows of every slot area: one slot of ``max_tokens`` per rank (none in a streamed layout)."""
        return 0 if self.stream_channels else self.num_ranks * self.max_tokens

    @property
    def stream(self) -> StreamSpace | None:
        """The stream space's layout (None: a slot layout). Its rows fit the widest row it carries:
        a BF16 token with ids and weights, an FP8 token with its scales too, or a combine row."""
        if not self.stream_channels:
            return None
        k, x16, x8 = self.num_topk, self.hidden // 4, self.hidden // 8
        words = max(row_words(x16, k, 0), row_words(x8, k, num_scales(self.hidden)), combine_row_words(x16, k))
        return StreamSpace(self.num_ranks, self.stream_channels, self.ring_rows, -(-words // 16) * 16)

    @property
    def meta_bytes(self) -> int:
        """Bytes of one meta row: ids, weights and scales, padded to 16."""
        return -(-(self.num_topk * 12 + num_scales(self.hidden) * 4) // 16) * 16

    def row_bytes(self, area: str) -> int:
        if area.startswith("board"):
            return board_words(self.num_ranks) * 8
        kind = area.split("_", 1)[1].split(".", 1)[0]
        return {"x": self.hidden * 2, "meta": self.meta_bytes, "w": self.num_topk * 4}[kind]

    def area_rows(self, area: str) -> int:
        """Rows of ``area``: a board has one per source, every other area ``rows``."""
        return self.num_ranks if area.startswith("board") else self.rows

    def offsets(self) -> dict[str, int]:
        return self._offsets

    @functools.cached_property
    def _offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for area in AREAS:
            out[area] = at
            at += -(-self.area_rows(area) * self.row_bytes(area) // _ALIGN) * _ALIGN
        stream = self.stream
        if stream is not None:
            out["stream"] = at
            at += -(-stream.nbytes // _ALIGN) * _ALIGN
        out["end"] = at
        return out

    @property
    def nbytes(self) -> int:
        return self.offsets()["end"]

    def view(self, region: torch.Tensor, area: str, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """``[rows, cols]`` view of ``area`` in a flat ``uint8`` region tensor, as ``dtype``."""
        start, rows = self.offsets()[area], self.area_rows(area)
        nbytes = rows * cols * dtype.itemsize
        if cols * dtype.itemsize > self.row_bytes(area):
            raise ConfigError(f"ep: {area} rows of {cols} x {dtype} exceed {self.row_bytes(area)} bytes per row")
        return region[start:start + nbytes].view(dtype).view(rows, cols)


def size_hint(max_tokens_per_rank: int, hidden: int, dtype: torch.dtype = torch.bfloat16, num_ranks: int = 8,
              num_topk: int = 8) -> int:
    """Bytes of device (or shared host) memory one rank's ep ``Buffer`` holds.

    Args:
        max_tokens_per_rank: the largest batch any rank dispatches.
        hidden: channels per token (a multiple of 8).
        dtype: token dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float8_e4m3fn``
            (regions are sized for 2-byte tokens, so FP8 needs no more).
        num_ranks: ranks of the group.
        num_topk: experts per token.

    Raises:
        ConfigError: a dtype dispatch does not take, or a size that is not a positive int.

    Example: ``size_hint(4096, 7168, torch.bfloat16, num_ranks=4)``: 1.11 GiB (1.19 GB) per rank.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise ConfigError(f"ep.size_hint: dtype={dtype!r}; expected torch.bfloat16, torch.float16 or torch.float8_e4m3fn")
    return RegionLayout(num_ranks, max_tokens_per_rank, hidden, num_topk).nbytes
