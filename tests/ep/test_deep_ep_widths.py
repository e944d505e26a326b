"""One deep_ep.Buffer takes calls of several hidden sizes and top-k widths within its budget, as
DeepEP's does (deep_ep.inner, Note [Built on first dispatch]): a narrower call is padded to the
Buffer's width and cut back, a wider one grows the Buffer once; every call kind equals a Buffer
built for exactly its shape. Spawned ranks over a gloo group on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ep._deep_ep_widths import widths_share_one_buffer
from tests.ep._deep_ep_workers import free_port
from tests.ep._group import run_ranks
from warmlink.ep.deep_ep.inner import narrow, widen
from warmlink.ep.deep_ep.sizing import needed_bytes
from warmlink.ep.fp8 import num_scales, quantize


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])], ids=["shm", "gpu"])
def test_calls_of_several_widths_share_one_buffer_and_equal_buffers_built_for_each(cuda):
    steps = [(256, 2), (128, 2), (130, 2), (384, 2), (256, 2), (201, 3)]  # 130 and 201: not whole 8-byte words
    case = {"tokens": [13, 0, 9], "experts": 6, "seed": 21, "steps": steps, "dist_port": free_port(),
            "budget": needed_bytes(16, 3, 384, 3), "cuda": cuda}
    for got in run_ranks(widths_share_one_buffer, 3, case=case, timeout_s=240):
        for step, same in zip(steps, got["steps"]):
            assert all(same.values()), (step, same)
        inner = got["inner"]
        # built for 256, top-2; 128 and 130 padded into it; 384 grew it; 256 padded into that; top-3 grew it again
        assert [i[1:3] for i in inner] == [(256, 2), (256, 2), (256, 2), (384, 2), (384, 2), (384, 3)], inner
        ids = [i[0] for i in inner]
        assert ids[0] == ids[1] == ids[2] and ids[3] == ids[4] and len({ids[0], ids[3], ids[5]}) == 3, inner
        assert inner[3][3] < inner[0][3], inner  # wider rows: fewer tokens per round, within the same budget
        assert "comes from another Buffer" in got["old_handle"], got
        assert got["nbytes"] <= case["budget"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("width, hidden", [(128, 128), (8, 128), (200, 7168), (2880, 7168), (0, 64)])
def test_widen_then_narrow_gives_the_rows_back(fp8, width, hidden):
    gen = torch.Generator().manual_seed(width + hidden)
    x = torch.randn(5, width, generator=gen).to(torch.bfloat16)
    tokens = quantize(x) if fp8 and width else x
    wide, got_width = widen(tokens, hidden)
    values = wide[0] if isinstance(wide, tuple) else wide
    assert got_width == width and values.shape == (5, max(width, hidden) if width else hidden)
    if isinstance(wide, tuple):
        assert wide[1].shape == (5, num_scales(hidden)) and not wide[1][:, num_scales(width):].any()
    assert not values.view(torch.uint8)[:, width * values.element_size():].any()  # zeros past the call's width
    back, cut = narrow(wide, width)
    assert cut == (width != hidden)
    for a, b in zip(back if isinstance(back, tuple) else (back,), tokens if isinstance(tokens, tuple) else (tokens,)):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and a.is_contiguous()
