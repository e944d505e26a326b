"""A receive region cut into chunks: what a fan-out relay serves, and which pulls fill each chunk.

Pure logic over ``Copy`` records (Note [Fan-out] in ``refit._relay``): nothing here touches memory.
The chunks depend only on where a plan's copies land in the receive region, which is the same
in every replica of one layout, so every replica cuts its region at the same addresses.

* The *served spans* are the hulls of the local byte ranges of the plan's copies (the publisher
  pulls), sorted and merged where less than ``MERGE_GAP_BYTES`` lies between them. A hull may
  hold bytes no pull writes: padding (zero in every replica), alignment gaps (never read) and the
  receive elements a staged pull's unstage fills (every replica unstages from its own scratch,
  which the spans hold). Copying those bytes from a relay is harmless.
* The spans are cut into ``num_chunks`` chunks of about equal bytes, each at most ``chunk_bytes``:
  chunk ``k`` is every span byte in ``[cuts[k], cuts[k + 1])``.
* Each publisher copy is split at the cuts (a flat copy into pieces; a strided one into groups of
  whole rows, a row that straddles a cut into a flat copy of its own, itself split), so that a
  chunk's publisher pulls write nothing outside it.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

from warmlink.transport.base import Copy

__all__ = ["Chunking", "chunking", "split_copies", "MERGE_GAP_BYTES"]

MERGE_GAP_BYTES = 4096  # spans this close are served as one: a copy per gap would cost more than its bytes


@dataclasses.dataclass(frozen=True)
class Chunking:
    """Chunks of a receive region. ``cuts``: ``num_chunks + 1`` byte addresses; ``pieces[k]``: the
    ``(offset, nbytes)`` spans of chunk ``k``, which a replica copies from its relay at the same
    offsets; ``chunk_bytes``: the bound each chunk keeps to."""

    cuts: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int], ...], ...]
    chunk_bytes: int

    @property
    def num_chunks(self) -> int:
        return len(self.pieces)

    @property
    def nbytes(self) -> int:
        """Bytes a relay serves: every chunk's spans."""
        return sum(n for chunk in self.pieces for _, n in chunk)

    def chunk_nbytes(self, k: int) -> int:
        return sum(n for _, n in self.pieces[k])


def _local_end(c: Copy) -> int:
    return c.local_offset + (c.num_rows - 1) * c.local_pitch + c.row_nbytes if c.num_rows > 1 else c.local_offset + c.row_nbytes


def _spans(copies: Sequence[Copy]) -> list[tuple[int, int]]:
    hulls = sorted((c.local_offset, _local_end(c)) for c in copies)
    out: list[list[int]] = []
    for lo, hi in hulls:
        if out and lo <= out[-1][1] + MERGE_GAP_BYTES:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def chunking(copies: Sequence[Copy], chunk_bytes: int) -> Chunking:
    """The chunks of the region ``copies`` land in (their ``local`` side), each at most
    ``chunk_bytes`` (> 0) of served bytes. At least one chunk, empty when there are no copies."""
    spans = _spans(copies)
    total = sum(hi - lo for lo, hi in spans)
    if total == 0:
        return Chunking((0, 0), ((),), chunk_bytes)
    num = -(-total // chunk_bytes)
    cuts, pieces = [spans[0][0]], []
    done, span_idx, at = 0, 0, spans[0][0]  # bytes of spans before ``at``; the span ``at`` lies in
    for k in range(1, num + 1):
        target = total * k // num  # even chunks: each at most chunk_bytes
        chunk = []
        while done < target:
            lo, hi = spans[span_idx]
            take = min(hi - at, target - done)
            chunk.append((at, take))
            at, done = at + take, done + take
            if at == hi and span_idx + 1 < len(spans):
                span_idx += 1
                at = spans[span_idx][0]
        cuts.append(at if k < num else spans[-1][1])
        pieces.append(tuple(chunk))
    return Chunking(tuple(cuts), tuple(pieces), chunk_bytes)


def split_copies(copies: Sequence[Copy], chunks: Chunking) -> list[list[Copy]]:
    """``copies`` split at ``chunks.cuts``: per chunk, the pieces whose local bytes lie in it."""
    out: list[list[Copy]] = [[] for _ in range(chunks.num_chunks)]
    cuts = chunks.cuts
    inner = cuts[1:-1]

    def chunk_of(addr: int) -> int:
        return bisect.bisect_right(inner, addr)

    for c in copies:
        for piece in _strided_pieces(c, inner) if c.num_rows > 1 else (c,):
            if piece.num_rows > 1:
                out[chunk_of(piece.local_offset)].append(piece)
                continue
            lo, hi = piece.local_offset, piece.local_offset + piece.row_nbytes
            while lo < hi:
                k = chunk_of(lo)
                end = min(hi, cuts[k + 1]) if k + 1 < len(cuts) - 1 else hi
                out[k].append(dataclasses.replace(piece, local_offset=lo, remote_offset=piece.remote_offset + (lo - piece.local_offset),
                                                  row_nbytes=end - lo))
                lo = end
    return out


def _strided_pieces(c: Copy, inner: Sequence[int]) -> list[Copy]:
    """A strided copy as groups of whole rows that no cut in ``inner`` crosses, and flat copies of
    the rows a cut crosses (split further by the caller)."""
    lo, end = c.local_offset, _local_end(c)
    out, row = [], 0
    for cut in inner[bisect.bisect_right(inner, lo):bisect.bisect_left(inner, end)]:
        r, within = divmod(cut - lo, c.local_pitch)
        before = r + 1 if within >= c.row_nbytes else r  # rows [row, before) end at or before the cut
        if before > row:
            out.append(_rows(c, row, before))
            row = before
        if r >= row and 0 < within < c.row_nbytes:  # row r straddles the cut
            out.append(_rows(c, r, r + 1))
            row = r + 1
    if row < c.num_rows:
        out.append(_rows(c, row, c.num_rows))
    return out


def _rows(c: Copy, first: int, stop: int) -> Copy:
    n = stop - first
    return dataclasses.replace(c, local_offset=c.local_offset + first * c.local_pitch,
                               remote_offset=c.remote_offset + first * c.remote_pitch, num_rows=n,
                               local_pitch=c.local_pitch if n > 1 else 0, remote_pitch=c.remote_pitch if n > 1 else 0)
