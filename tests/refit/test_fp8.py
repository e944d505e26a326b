"""Block-wise FP8 (warmlink.refit.fp8): the bytes and scales, shards that quantize as their part of
the whole, and refusals. vLLM's own quantizer is the reference in tests/integrations/test_vllm.py
(bit for bit, where vLLM is installed)."""

from __future__ import annotations

import pytest
import torch

from warmlink.errors import ConfigError
from warmlink.refit.fp8 import BLOCK, FP8_MAX, block_fp8, dequantize_block_fp8


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 1, n, dtype=torch.float32)[torch.randperm(n, generator=gen)]  # rows of every magnitude
    return (torch.randn(n, k, generator=gen) * scales[:, None]).to(torch.bfloat16)


def _per_block(weight: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization one block at a time, with plain slicing."""
    n, k = weight.shape
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale = max(float(part.abs().float().max()), 1e-4) / FP8_MAX
            scales[i, j] = torch.tensor(scale, dtype=torch.float32)
            values[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (part.float() * (1.0 / scales[i, j])).to(torch.float8_e4m3fn)
    return values, scales


@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (576, 128), (1, 1)])
def test_values_and_scales_match_block_by_block_quantization(shape):
    w = _weight(*shape)
    values, scales = block_fp8(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == w.shape
    assert scales.dtype == torch.float32 and scales.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    want_values, want_scales = _per_block(w, *BLOCK)
    assert torch.equal(scales, want_scales)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))


def test_dequantized_weights_are_within_half_a_step_of_the_originals():
    w = _weight(384, 512, seed=1)
    values, scales = block_fp8(w)
    back = dequantize_block_fp8(values, scales)
    step = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)  # e4m3's top binade steps by 32 x scale
    assert ((back - w.float()).abs() <= 16 * step * (1 + 1e-6)).all()
    assert (values.float().abs().amax() <= FP8_MAX) and not torch.isnan(values.float()).any()


@pytest.mark.parametrize("dim", [0, 1])
def test_a_shard_cut_at_128_quantizes_as_its_part_of_the_whole(dim):
    """TP 2 of a column- (dim 0) or row-parallel (dim 1) layer: each rank's shard, quantized alone,
    is its slice of the whole tensor's values and scales, bit for bit."""
    w = _weight(512, 768, seed=2)
    values, scales = block_fp8(w)
    for rank, shard in enumerate(w.chunk(2, dim)):
        v, s = block_fp8(shard)
        assert torch.equal(v.view(torch.uint8), values.chunk(2, dim)[rank].view(torch.uint8))
        assert torch.equal(s, scales.chunk(2, dim)[rank])


def test_a_block_of_zeros_gets_a_finite_scale_and_zeros():
    w = torch.zeros(128, 256, dtype=torch.bfloat16)
    w[:, 128:] = 1.0
    values, scales = block_fp8(w)
    assert scales.tolist() == [[pytest.approx(1e-4 / FP8_MAX), pytest.approx(1.0 / FP8_MAX)]]
    assert (values[:, :128].float() == 0).all() and (values[:, 128:].float() == FP8_MAX).all()


@pytest.mark.parametrize("weight,block,match", [
    (torch.zeros(4), BLOCK, "2-D tensor"),
    (torch.zeros(4, 4, dtype=torch.int32), BLOCK, "weight.dtype=torch.int32"),
    (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), BLOCK, "float8_e4m3fn"),
    (torch.zeros(4, 4), (0, 128), r"block=\(0, 128\)"),
])
def test_bad_weights_and_blocks_are_refused_naming_them(weight, block, match):
    with pytest.raises(ConfigError, match=match):
        block_fp8(weight, block)
