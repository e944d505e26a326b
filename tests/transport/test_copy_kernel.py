"""The multi-copy kernel of ``transport._copy_kernel`` (Note [Copy kernel]), run by Triton's
interpreter on host memory: every variant copies 1-D and strided copies exactly, and copies it
cannot take (not 16-byte aligned) are left in ``rest``. On a GPU, every cuda_ipc pull between two
processes sharing the device goes through it (tests/refit/test_layouts_gpu.py and the refit GPU tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

CHILD = textwrap.dedent('''
    import torch
    from warmlink.transport import _copy_kernel as ck

    g = torch.Generator().manual_seed(0)
    sizes = (64, 4096 + 16, 48, 100, 32, 20000)
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    dst = torch.zeros(40000, dtype=torch.uint8)
    offs = [0, 256, 4608, 4864, 5120, 5376]
    copies = [(dst.data_ptr() + o, s.data_ptr(), s.numel(), 1, 0, 0) for o, s in zip(offs, srcs)]
    # strided: 10 rows of 48 bytes from a pitch-64 source into a pitch-80 destination
    src2 = torch.randint(0, 255, (640,), dtype=torch.uint8, generator=g)
    copies.append((dst.data_ptr() + 30000, src2.data_ptr(), 48, 10, 80, 64))
    for variant in ("v1", "v2", "v3"):
        dst.zero_()
        plan = ck.CopyPlan(copies, device=-1, chunk_nbytes=1024)
        assert [c[2] for c in plan.rest] == [100], plan.rest  # 100 bytes: not a multiple of 16
        assert plan.nbytes == sum(n for n in sizes if n % 16 == 0) + 480
        kernel, aligned, tiles = ck.get_kernel(variant)
        kernel[(plan.num_programs,)](plan.table, BLOCK=64, ALIGNED=aligned, TILES=tiles)
        for o, s in zip(offs, srcs):
            want = s if s.numel() % 16 == 0 else torch.zeros_like(s)
            assert torch.equal(dst[o:o + s.numel()], want), (variant, o)
        for r in range(10):
            assert torch.equal(dst[30000 + 80 * r:30000 + 80 * r + 48], src2[64 * r:64 * r + 48]), (variant, r)
            assert bool((dst[30000 + 80 * r + 48:30000 + 80 * r + 80] == 0).all()), (variant, r)
    print("ok")
''')


def test_every_variant_copies_exactly_in_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _reference_table(copies, chunk_nbytes):
    """The table as the kernel reads it, row by row: (src, dst, row words, rows, src pitch words,
    dst pitch words) per program; long single rows cut at ``chunk_nbytes``, else whole rows."""
    table = []
    for dst, src, row_nbytes, rows, dst_pitch, src_pitch in copies:
        if rows == 1:
            dst_pitch = src_pitch = row_nbytes
        if any(v % 16 for v in (dst, src, row_nbytes, dst_pitch, src_pitch)):
            continue
        if rows == 1 and row_nbytes > chunk_nbytes:
            for o in range(0, row_nbytes, chunk_nbytes):
                words = min(chunk_nbytes, row_nbytes - o) // 16
                table.append((src + o, dst + o, words, 1, words, words))
            continue
        per = max(1, chunk_nbytes // row_nbytes)
        table += [(src + r * src_pitch, dst + r * dst_pitch, row_nbytes // 16, min(per, rows - r), src_pitch // 16,
                   dst_pitch // 16) for r in range(0, rows, per)]
    return table


_copies = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 1 << 16), st.integers(1, 40),
                             st.integers(1, 1 << 17), st.integers(1, 1 << 17)).map(
    lambda c: (c[0] * 16 if c[0] % 3 else c[0], c[1] * 16, c[2] * 16 if c[2] % 5 else c[2], c[3], c[4] * 16, c[5] * 16)),
    max_size=12)


@settings(max_examples=150, deadline=None)
@given(copies=_copies, chunk_nbytes=st.sampled_from([16, 1024, 128 << 10]))
def test_the_table_holds_one_row_per_program_of_every_aligned_copy(copies, chunk_nbytes) -> None:
    import torch

    from warmlink.transport import _copy_kernel as ck

    plan = ck.CopyPlan(copies, device=-1, chunk_nbytes=chunk_nbytes)
    want = _reference_table(copies, chunk_nbytes)
    got = [] if plan.table is None else [tuple(r) for r in plan.table.reshape(-1, 6).tolist()]
    assert got == want and plan.num_programs == len(want)
    assert plan.rest == [(d, s, n, r, dp if r > 1 else n, sp if r > 1 else n) for d, s, n, r, dp, sp in copies
                         if any(v % 16 for v in (d, s, n) + ((dp, sp) if r > 1 else ()))]
    assert plan.table is None or plan.table.dtype == torch.int64
