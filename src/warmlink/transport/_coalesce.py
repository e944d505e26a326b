"""Bounds checks and coalescing of copy lists (pure; shared by every backend)."""

from __future__ import annotations

from typing import Sequence

from warmlink.errors import ConfigError

__all__ = ["validate", "coalesce"]


def _span(offset: int, rows: int, pitch: int, row_nbytes: int) -> int:
    return offset + (rows - 1) * pitch + row_nbytes if rows > 1 else offset + row_nbytes


def validate(c, idx: int) -> None:
    """Raise ConfigError if copy ``c`` (number ``idx``) reaches outside its regions."""
    for field in ("local_offset", "remote_offset", "row_nbytes", "num_rows", "local_pitch", "remote_pitch"):
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"Link.prepare: copies[{idx}].{field}={v!r}; expected an int >= 0")
    if c.row_nbytes == 0 or c.num_rows == 0:
        raise ConfigError(f"Link.prepare: copies[{idx}] moves 0 bytes (row_nbytes={c.row_nbytes}, num_rows={c.num_rows})")
    if c.num_rows > 1 and (c.local_pitch < c.row_nbytes or c.remote_pitch < c.row_nbytes):
        raise ConfigError(
            f"Link.prepare: copies[{idx}] pitches ({c.local_pitch}, {c.remote_pitch}) < row_nbytes={c.row_nbytes}; "
            "rows would overlap"
        )
    end = _span(c.local_offset, c.num_rows, c.local_pitch, c.row_nbytes)
    if end > c.local.nbytes:
        raise ConfigError(f"Link.prepare: copies[{idx}] local end={end} > local region nbytes={c.local.nbytes}")
    end = _span(c.remote_offset, c.num_rows, c.remote_pitch, c.row_nbytes)
    if end > c.remote.nbytes:
        raise ConfigError(
            f"Link.prepare: copies[{idx}] remote end={end} > region nbytes={c.remote.nbytes} of peer={c.remote.peer.key!r}"
        )


def coalesce(copies: Sequence) -> tuple[list, list]:
    """Split into 1-D and 2-D copies and merge 1-D copies contiguous on both sides.

    A 2-D copy whose pitches equal its row size on both sides is really 1-D and joins the flat
    list. Flat copies are sorted by (remote region, remote offset) so that adjacent ones meet.
    """
    from dataclasses import replace

    flat, strided = [], []
    for c in copies:
        if c.num_rows == 1:
            flat.append(c)
        elif c.local_pitch == c.row_nbytes and c.remote_pitch == c.row_nbytes:
            flat.append(replace(c, row_nbytes=c.nbytes, num_rows=1, local_pitch=0, remote_pitch=0))
        else:
            strided.append(c)
    flat.sort(key=lambda c: (id(c.remote), c.remote_offset, id(c.local), c.local_offset))
    merged: list = []
    for c in flat:
        if merged:
            p = merged[-1]
            if (
                p.remote is c.remote
                and p.local is c.local
                and p.remote_offset + p.row_nbytes == c.remote_offset
                and p.local_offset + p.row_nbytes == c.local_offset
            ):
                merged[-1] = replace(p, row_nbytes=p.row_nbytes + c.row_nbytes)
                continue
        merged.append(c)
    return merged, strided
