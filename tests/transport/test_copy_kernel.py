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
