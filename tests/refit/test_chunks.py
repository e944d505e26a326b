"""``refit._chunks``: a receive region cut into chunks, and the pulls that fill each (Note [Fan-out]).

Checked against a byte map written independently of the code: every byte a copy writes is written
by exactly one piece, from the same remote byte, and that piece lies in the chunk whose address
range holds the byte; the chunks' spans cover every written byte, each chunk within its bound.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.refit._chunks import MERGE_GAP_BYTES, chunking, split_copies
from warmlink.transport.base import Copy

REGION = 1 << 16


class _Region:
    """Stands for a region in a Copy: only ``nbytes`` is read here."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


LOCAL, REMOTE = _Region(REGION), _Region(1 << 20)


def _writes(c: Copy) -> dict[int, int]:
    """local byte -> remote byte of every byte ``c`` moves."""
    out = {}
    for i in range(c.num_rows):
        lo = c.local_offset + i * (c.local_pitch if c.num_rows > 1 else 0)
        ro = c.remote_offset + i * (c.remote_pitch if c.num_rows > 1 else 0)
        for b in range(c.row_nbytes):
            out[lo + b] = ro + b
    return out


@st.composite
def disjoint_copies(draw) -> list[Copy]:
    """1..6 flat or strided copies whose local bytes do not overlap (a plan's never do)."""
    out, taken, cursor = [], set(), 0
    for _ in range(draw(st.integers(1, 6))):
        cursor += draw(st.integers(0, 2 * MERGE_GAP_BYTES))
        rows = draw(st.integers(1, 6))
        row = draw(st.integers(1, 600))
        pitch = row + draw(st.integers(0, 600)) if rows > 1 else 0
        c = Copy(LOCAL, cursor, REMOTE, draw(st.integers(0, 1 << 18)), row, rows, pitch, row + draw(st.integers(0, 64)) if rows > 1 else 0)
        written = set(_writes(c))
        if max(written) >= REGION or written & taken:
            break
        taken |= written
        out.append(c)
        cursor = max(written) + 1
    return out


@settings(max_examples=150, deadline=None)
@given(copies=disjoint_copies(), chunk_bytes=st.integers(1, 5000))
def test_every_written_byte_lands_in_one_piece_of_its_chunk(copies, chunk_bytes):
    chunks = chunking(copies, chunk_bytes)
    parts = split_copies(copies, chunks)
    assert len(parts) == chunks.num_chunks == len(chunks.cuts) - 1
    expected = {}
    for c in copies:
        expected.update(_writes(c))
    got = {}
    for k, pieces in enumerate(parts):
        for p in pieces:
            for local, remote in _writes(p).items():
                assert local not in got, f"byte {local} written twice"
                assert chunks.cuts[k] <= local < chunks.cuts[k + 1], f"byte {local} of chunk {k} outside {chunks.cuts[k:k + 2]}"
                got[local] = remote
    assert got == expected
    # the spans: each chunk's within its cut range and bound; together they hold every written byte
    served = set()
    for k, spans in enumerate(chunks.pieces):
        assert chunks.chunk_nbytes(k) <= chunk_bytes
        for o, n in spans:
            assert chunks.cuts[k] <= o and o + n <= chunks.cuts[k + 1] and n > 0
            served.update(range(o, o + n))
    assert set(expected) <= served
    assert chunks.nbytes == len(served)


def test_spans_close_together_are_served_as_one():
    a = Copy(LOCAL, 0, REMOTE, 0, 1000)
    b = Copy(LOCAL, 1000 + MERGE_GAP_BYTES, REMOTE, 5000, 1000)
    c = Copy(LOCAL, 2000 + 2 * MERGE_GAP_BYTES + 1, REMOTE, 9000, 1000)
    chunks = chunking([a, b, c], 1 << 20)
    assert chunks.pieces == (((0, 2000 + MERGE_GAP_BYTES), (2000 + 2 * MERGE_GAP_BYTES + 1, 1000)),)


def test_a_row_longer_than_a_chunk_is_split_across_chunks():
    strided = Copy(LOCAL, 100, REMOTE, 0, 3000, 3, 4000, 3000)  # rows at 100, 4100, 8100
    chunks = chunking([strided], 1000)
    parts = split_copies([strided], chunks)
    assert chunks.num_chunks == (8100 + 3000 - 100 + 999) // 1000
    assert all(p.num_rows == 1 and p.row_nbytes <= 1000 for piece in parts for p in piece)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 4096])
def test_no_copies_make_one_empty_chunk(chunk_bytes):
    chunks = chunking([], chunk_bytes)
    assert chunks.num_chunks == 1 and chunks.nbytes == 0 and split_copies([], chunks) == [[]]
