"""``ep.wire.fp8``: DeepEP's per-128-channel FP8 format, also for hidden sizes that are not multiples of 128."""

from __future__ import annotations

import pytest
import torch

from warmlink.ep.wire.fp8 import FP8_MAX, dequantize, num_scales, quantize
from warmlink.errors import ConfigError


@pytest.mark.parametrize("hidden", [128, 7168, 2880, 8, 136])
def test_quantize_scales_each_block_by_its_own_largest_value_and_round_trips(hidden: int) -> None:
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(hidden)) * 3
    q, scales = quantize(x)
    assert q.shape == (5, hidden) and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert scales.shape == (5, num_scales(hidden)) and scales.dtype == torch.float32
    for b in range(num_scales(hidden)):  # the last block may be short: its zeros never raise its scale
        block = x[:, b * 128:(b + 1) * 128]
        torch.testing.assert_close(scales[:, b], block.abs().amax(dim=1) / FP8_MAX)
    back = dequantize(q, scales, torch.float32)
    assert back.shape == x.shape
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of its magnitude, plus the block's smallest step
    assert bool(((back - x).abs() <= x.abs() / 16 + scales.repeat_interleave(128, dim=1)[:, :hidden] * 2 ** -9).all())


def test_quantize_refuses_what_is_not_a_matrix() -> None:
    with pytest.raises(ConfigError, match=r"expected \[tokens, hidden\]"):
        quantize(torch.zeros(4))


def test_a_rank_without_tokens_quantizes_to_empty_tensors() -> None:
    q, scales = quantize(torch.zeros(0, 2880))
    assert q.shape == (0, 2880) and scales.shape == (0, 23)
    assert dequantize(q, scales).shape == (0, 2880)
