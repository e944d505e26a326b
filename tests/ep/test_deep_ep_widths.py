"""One deep_ep.Buffer takes calls of several hidden sizes and top-k widths within its budget, as
DeepEP's does (deep_ep.inner, Note [Built on first dispatch]): a narrower call is padded to the
Buffer's width and cut back, a wider one grows the Buffer once; every call kind equals a Buffer
built for exactly its shape. Spawned ranks over a gloo group on the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ep._deep_ep_widths import widths_share_one_buffer
from tests.ep._deep_ep_workers import free_port
from tests.ep._group import run_ranks
from warmlink.ep.deep_ep.inner import narrow, widen
from warmlink.ep.deep_ep.sizing import needed_bytes
from warmlink.ep.wire.fp8 import num_scales, quantize


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])], ids=["shm", "gpu"])
def test_calls_of_several_widths_share_one_buffer_and_equal_buffers_built_for_each(cuda, monkeypatch):
    monkeypatch.setenv("WARMLINK_EP_STREAM_KERNEL", "triton")  # slots on GPUs too (the CUDA kernels stream: deep_ep.inner)
    steps = [(256, 2), (128, 2), (130, 2), (384, 2), (256, 2), (201, 3)]  # 130 and 201: not whole 8-byte words
    case = {"tokens": [13, 0, 9], "experts": 6, "seed": 21, "steps": steps, "dist_port": free_port(),
            "budget": needed_bytes(16, 3, 384, 3), "cuda": cuda}
    for got in run_ranks(widths_share_one_buffer, 3, case=case, timeout_s=240):
        for step, same in zip(steps, got["steps"]):
            assert all(same.values()), (step, same, got.get("diag"))
        inner = got["inner"]
        # built for 256, top-2; 128 and 130 padded into it; 384 grew it; 256 padded into that; top-3 grew it again
        assert [i[1:3] for i in inner] == [(256, 2), (256, 2), (256, 2), (384, 2), (384, 2), (384, 3)], inner
        ids = [i[0] for i in inner]
        assert ids[0] == ids[1] == ids[2] and ids[3] == ids[4] and len({ids[0], ids[3], ids[5]}) == 3, inner
        assert inner[3][3] < inner[0][3], inner  # wider rows: fewer tokens per round, within the same budget
        assert "comes from another Buffer" in got["old_handle"], got
        assert got["nbytes"] <= case["budget"]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 6), st.integers(0, 300), st.integers(0, 200), st.booleans(), st.booleans())
def test_widen_then_narrow_gives_the_rows_back(rows, width, extra, fp8, odd_scales):
    """Any rows, width and wider hidden size, BF16 or FP8: widening pads zeros (values and scales)
    past the call's width, narrowing gives back the call's bytes as fresh tensors; FP8 scales of
    the wrong shape are left for ep's checks to refuse by name."""
    hidden = max(width + extra, 1)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width * 7 + rows)).to(torch.bfloat16)
    if not rows:  # an empty tensor's strides may be any (a rank that receives nothing)
        x = x.as_strided((0, width), (1, 0))
    tokens = quantize(x) if fp8 else x
    if fp8 and odd_scales:
        tokens = (tokens[0], tokens[1][:, :-1] if tokens[1].shape[1] else torch.zeros(rows, 1))
    wide, got_width = widen(tokens, hidden)
    assert got_width == width
    if fp8 and odd_scales:
        assert wide is tokens  # unchanged: ep refuses the scales' shape, naming it
        return
    values = wide[0] if isinstance(wide, tuple) else wide
    assert values.shape == (rows, max(width, hidden)) and values.dtype == (tokens[0] if fp8 else tokens).dtype
    assert not values.float()[:, width:].any()  # zeros past the call's width
    if isinstance(wide, tuple):
        assert wide[1].shape == (rows, num_scales(max(width, hidden))) and not wide[1][:, num_scales(width):].any()
    back, cut = narrow(wide, width)
    assert cut == (width < hidden)
    for a, b in zip(back if isinstance(back, tuple) else (back,), tokens if isinstance(tokens, tuple) else (tokens,)):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.float(), b.float()) and a.is_contiguous()


def test_the_largest_first_batch_is_agreed_over_the_store_and_a_bad_count_is_refused():
    """deep_ep.inner._most_tokens (a GPU build's choice between slots and streaming): every rank's
    count through the rendezvous store, the largest on every rank; a count that is not one is
    refused by name; a rank that never writes costs a timeout."""
    import threading
    from types import SimpleNamespace

    from warmlink.ep.deep_ep.inner import _most_tokens
    from warmlink.errors import MetadataError, TransferTimeout
    from warmlink.rendezvous import Store

    with Store(is_server=True, prefix="most-tokens", timeout_s=10) as store:
        def owner(rank: int, size: int, exchanges: int, timeout_s: float = 5.0):
            return SimpleNamespace(rank=rank, group_size=size, _exchanges=exchanges, _timeout_s=timeout_s,
                                   _rendezvous=lambda: store)

        owners = [owner(r, 3, 0) for r in range(3)]
        got = [None] * 3

        def call(r: int) -> None:
            got[r] = _most_tokens(owners[r], torch.zeros(7 * r + 2, 4))

        threads = [threading.Thread(target=call, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got == [16, 16, 16] and [o._exchanges for o in owners] == [1, 1, 1]
        store.set("deep_ep/most/2/1", b"-5")
        with pytest.raises(MetadataError, match="rank 1's token count under 'deep_ep/most/2' is '-5'"):
            _most_tokens(owner(0, 2, 1), torch.zeros(3, 4))
        with pytest.raises(TransferTimeout, match="deep_ep/most/3/1"):
            _most_tokens(owner(0, 2, 2, timeout_s=0.5), torch.zeros(3, 4))
