"""What ep's device steps are given: a dispatch's rows, a padded unpack's board, and the call
block of a replayed send.

``Sources`` is what a dispatch sends per token; ``Padded`` where a padded dispatch's unpack learns
how many rows came. ``CALL_SLOTS`` names the words of the call block
from which a graph-replayed send's kernels read everything that changes per call (ep.paths.sm_pushes,
Note [Fresh send graph]); both the launches (ep.kernels.steps) and the kernels (ep.kernels.programs) read this
module, which imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["CALL_SLOTS", "FreshShape", "Padded", "Sources", "call_words", "scale_words"]


@dataclass(frozen=True)
class Sources:
    """What a dispatch sends per token: ``x`` as int64 words ``[T, W]``, and the optional parts of
    its meta row: ``topk`` ``[T, k]`` ids, ``weights`` ``[T, k]`` float, ``scales`` ``[T, S]`` float32
    with any strides (ep.kernels.steps, Note [Scales in place])."""

    x: torch.Tensor
    topk: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    @property
    def has_meta(self) -> bool:
        return self.topk is not None or self.scales is not None

    @property
    def scale_strides(self) -> tuple[int, int]:
        """``(token stride, column stride)`` of ``scales``, in float32 elements; ``(0, 0)`` without."""
        return tuple(self.scales.stride()) if self.scales is not None else (0, 0)


class Padded(NamedTuple):
    """A padded dispatch's ``[R, board row]`` count board of ``round`` (a copy), and this rank
    (ep.protocol.normal, Note [Padded dispatch returns at launch])."""

    board: torch.Tensor
    round: int
    rank: int

    def received(self, rows: int) -> int:
        """The kernel's rows received, on the host: 0 for a round with a late or refused source,
        or a rank receiving more than ``rows``."""
        board, r = self.board.cpu(), self.board.shape[0]
        totals = board[:, 2:2 + r].sum(0)
        ok = bool((board[:, 0] == self.round).all() and board[:, 1].all() and totals.max() <= rows)
        return int(totals[self.rank]) if ok else 0


# What a fresh SM send's kernels read per call from the call block (Note [Fresh send graph]).
# The scales' strides are words of the block, not fields of FreshShape or the cached push's key:
# DeepEP's column-major scales have a column stride of T, which changes with the token count, so a
# key would capture a graph per count; read per call, one graph serves row-major and column-major
# calls alike, and no call replays strides captured for another (ep.kernels.steps, Note [Scales in place]).
# The last word, ``board_copy``, is where the exchange also writes the round's board on the device (a
# padded dispatch's copy, which its stream and its handle read), or 0 for none.
CALL_SLOTS = ("in_rank", "topk", "per_rank", "per_expert", "rows", "x", "weights", "scales", "scales_token_stride",
              "scales_col_stride", "tokens", "round", "config", "board_copy")


@dataclass(frozen=True)
class FreshShape:
    """What a fresh SM send's kernels are specialized for: with the parity, the key of its graph."""

    num_ranks: int
    num_experts: int
    num_k: int  # top-k ids per token
    x_words: int  # int64 words per row of x
    num_scales: int  # FP8 scales per row (0: BF16/FP16)
    max_tokens: int
    meta_k: int  # the buffer's num_topk
    meta_bytes: int
    topk: torch.dtype
    per_rank: torch.dtype
    per_expert: torch.dtype
    weights: torch.dtype | None


def call_words(in_rank: torch.Tensor, topk: torch.Tensor, per_rank: torch.Tensor, per_expert: torch.Tensor,
               rows: torch.Tensor, src: Sources, round_: int, config: int,
               board_copy: torch.Tensor | None = None) -> tuple[int, ...]:
    """The call block's words (``CALL_SLOTS``) of one fresh SM send (``config``: its config word,
    ep.wire.words, which the count exchange compares across ranks; ``board_copy``: a ``[R, board
    row]`` int64 device tensor the exchange copies the board into, or None); every tensor but the
    scales must be contiguous (the kernels see only its address; the scales' strides are words too)."""
    tensors = (in_rank, topk, per_rank, per_expert, rows, src.x, *(t for t in (src.weights,) if t is not None))
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("call_words: every tensor but the scales must be contiguous")
    return (in_rank.data_ptr(), topk.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(), rows.data_ptr(),
            src.x.data_ptr(), src.weights.data_ptr() if src.weights is not None else 0, *scale_words(src),
            rows.shape[0], round_, config, board_copy.data_ptr() if board_copy is not None else 0)


def scale_words(src: Sources) -> tuple[int, int, int]:
    """The call block's ``scales``, ``scales_token_stride`` and ``scales_col_stride`` words of
    ``src``: the caller's own address and strides (in float32 elements), 0s without scales."""
    return (src.scales.data_ptr() if src.scales is not None else 0, *src.scale_strides)
