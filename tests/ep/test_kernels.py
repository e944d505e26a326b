"""Runs ``interpreted_kernels.py`` (the ep kernels against their torch versions) and
``interpreted_ll_kernels.py`` (low-latency mode's device path against its host path) in child
pytests with Triton's interpreter, which must be chosen before Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def _interpreted(name: str) -> None:
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / name)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=here.parent.parent)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def test_ep_kernels_equal_their_torch_versions_in_the_interpreter():
    _interpreted("interpreted_kernels.py")


def test_low_latency_device_path_equals_the_host_path_in_the_interpreter():
    _interpreted("interpreted_ll_kernels.py")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_ep_kernels_on_the_gpu_equal_the_torch_versions_at_deepseek_shapes():
    import torch

    from warmlink.ep.kernels import layout_cuda, steps as _kernels
    from warmlink.ep.kernels.layout import dispatch_layout

    gen = torch.Generator().manual_seed(5)
    tokens, num_ranks, num_experts, k, hidden, max_tokens, meta_k = 4096, 4, 256, 8, 7168, 4096, 8
    topk = torch.rand(tokens, num_experts, generator=gen).argsort(1)[:, :k].contiguous()
    topk[torch.rand(tokens, k, generator=gen) < 0.05] = -1
    weights = torch.rand(tokens, k, generator=gen)
    scales = torch.rand(tokens, hidden // 128, generator=gen)
    x = torch.randint(-2**62, 2**62, (tokens, hidden * 2 // 8), generator=gen)
    lay = dispatch_layout(topk, num_experts, num_ranks)
    want_rows, want_words = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, max_tokens)
    dev = torch.device("cuda", 0)
    bad = topk.clone()
    bad[::9, 0] = num_experts + 1
    # the layout in one launch on CUDA (ep.kernels.steps.layout) against torch's, twice: the CUDA
    # block (int64 and int32 ids, a token count past a block's step, top-6 of 288 over 8 ranks) and,
    # past its MAX_TOKENS, the Triton grid
    many = torch.randint(-1, 288, (layout_cuda.MAX_TOKENS + 5, k), generator=gen)
    cases = [(topk, num_experts, num_ranks, True), (bad, num_experts, num_ranks, True),
             (bad.int(), num_experts, num_ranks, True), (bad[:1500, :6], 288, 8, True), (many, 288, 8, False)]
    for ids, experts, ranks, one_block in cases:
        want_lay = dispatch_layout(ids, experts, ranks)
        assert layout_cuda.fits(ids.to(dev), experts, ranks) == one_block
        for _ in range(2):
            got_lay = dispatch_layout(ids.to(dev), experts, ranks)
            for name in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "num_bad_ids"):
                assert torch.equal(getattr(got_lay, name).cpu(), getattr(want_lay, name)), (name, ids.shape, ids.dtype)
    cuda = [t.to(dev) for t in (lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert)]
    for _ in range(2):
        rows, words = _kernels.plan(*cuda, max_tokens)
        assert torch.equal(rows.cpu(), want_rows) and torch.equal(words.cpu(), want_words)
    meta_bytes = 320
    src = _kernels.Sources(x, topk, weights, scales)
    src_gpu = _kernels.Sources(*(t.to(dev) for t in (x, topk, weights, scales)))
    # DeepEP's column-major scales, read in place through their strides (ep.kernels.steps, Note [Scales in place])
    by_column = _kernels.Sources(src_gpu.x, src_gpu.topk, src_gpu.weights, src_gpu.scales.T.contiguous().T)
    for dests, skip, shift in ((range(num_ranks), 1, 0), (range(2, 3), -1, -2 * max_tokens + 7)):
        want_x = torch.full((num_ranks * max_tokens, x.shape[1]), -7, dtype=torch.int64)
        want_m = torch.full((num_ranks * max_tokens, meta_bytes), 0xAB, dtype=torch.uint8)
        got_x, got_m = want_x.to(dev), want_m.to(dev)
        _kernels.gather(want_rows, src, want_x, want_m, meta_k, dests, shift=shift, skip=skip)
        for _ in range(2):  # the first launch compiles through Triton, the second goes straight in (ep.kernels.launch)
            for source in (src_gpu, by_column):
                got_x.fill_(-7)
                got_m.fill_(0xAB)
                _kernels.gather(rows, source, got_x, got_m, meta_k, dests, shift=shift, skip=skip)
                assert torch.equal(got_x.cpu(), want_x) and torch.equal(got_m.cpu(), want_m)
        idx = [torch.full((want_m.shape[0], k), 5, dtype=torch.int64, device=d) for d in ("cpu", dev)]
        w = [torch.full((want_m.shape[0], k), 5.0, device=d) for d in ("cpu", dev)]
        sc = [torch.full((want_m.shape[0], hidden // 128), 5.0, device=d) for d in ("cpu", dev)]
        _kernels.unpack(want_m, meta_k, idx[0], w[0], sc[0], 64, 64)
        _kernels.unpack(got_m, meta_k, idx[1], w[1], sc[1], 64, 64)
        assert torch.equal(idx[1].cpu(), idx[0])
        assert torch.equal(w[1].cpu().view(torch.int32), w[0].view(torch.int32))
        assert torch.equal(sc[1].cpu().view(torch.int32), sc[0].view(torch.int32))
    # the combine's sum against the torch sum: bit-exact on CUDA
    from warmlink.ep.kernels import reduce as _reduce

    area = torch.randn(max_tokens, hidden, generator=gen).bfloat16()
    own = torch.randn(max_tokens, hidden, generator=gen).bfloat16()
    sum_rows = torch.where(want_rows >= 0, want_rows % max_tokens, -1)  # each rank's rows from 0
    sum_rows[::7] = -1  # tokens that went nowhere
    want = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    _reduce.combine_sum(area, sum_rows, want, local=(own, 1, 0), use_triton=False)
    got = torch.full((tokens, hidden), 3.0, dtype=torch.bfloat16, device=dev)
    _reduce.combine_sum(area.to(dev), sum_rows.to(dev), got, local=(own.to(dev), 1, 0))
    assert torch.equal(got.cpu(), want)


def test_every_named_kernel_wraps_the_triton_kernel_of_its_name():
    """``_kernels()`` (what CUDA calls launch) names each ep.kernels.programs kernel once, wrapped for fast
    launches; a name pointing at another kernel would only fail on a GPU."""
    from warmlink.ep.kernels import steps as _kernels
    from warmlink.ep.kernels import programs as _triton
    from warmlink.ep.kernels.launch import FastLaunch

    _kernels._kernels.cache_clear()
    try:
        wrapped = _kernels._kernels()
    finally:
        _kernels._kernels.cache_clear()
    assert isinstance(wrapped, _kernels.Kernels)
    for name in wrapped._fields[1:]:
        launcher = getattr(wrapped, name)
        assert isinstance(launcher, FastLaunch), name
        assert launcher.jit is getattr(_triton, f"{name}_kernel"), name



@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_stream_makes_a_stream_current_and_restores_the_callers():
    """ep.kernels.launch.on_stream, the receive work's cheap ``torch.cuda.stream``: work inside runs on the
    side stream, and the caller's own (non-default) stream is current again after it, also after an
    exception."""
    import torch

    from warmlink.ep.kernels.launch import current_stream, on_stream

    dev = torch.cuda.current_device()
    mine, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with torch.cuda.stream(mine):
        with on_stream(side):
            assert torch.cuda.current_stream(dev) == side and current_stream(dev) == side.cuda_stream
            x = torch.ones(1024, device=dev) * 2
        assert torch.cuda.current_stream(dev) == mine
        with pytest.raises(RuntimeError, match="inside"):
            with on_stream(side):
                raise RuntimeError("inside")
        assert torch.cuda.current_stream(dev) == mine
    side.synchronize()
    assert float(x.sum()) == 2048
