"""Block-wise FP8 weights as vLLM's block-quantized linear layers hold them.

DeepSeek-V3, Kimi-K2 and Qwen3's FP8 checkpoints store each linear weight ``[N, K]`` as float8
e4m3 values and a float32 ``weight_scale_inv`` ``[ceil(N / 128), ceil(K / 128)]``, one per
128 x 128 block; vLLM's ``Fp8LinearMethod`` with a ``weight_block_size`` loads both and
multiplies each block by its scale (hence "inv": the scale that dequantizes). A trainer in BF16
that feeds such an engine quantizes each weight this way before it sends, which halves the bytes
on the wire (docs/scale.md: the replica's ingress bounds a sync, so the sync halves too).

The arithmetic is vLLM's reference (its ``per_block_cast_to_fp8``): per block the absolute
maximum in float32, at least 1e-4; the scale that amax over 448 (e4m3's largest value); the
values multiplied by the scale's reciprocal in float32, then cast to e4m3 (round to nearest
even). A partial block at the edge takes its amax over the elements it has. Every block stands
alone, so a shard cut at multiples of 128 quantizes to the same bytes and scales as its part of
the whole tensor: a trainer may quantize its shard and an engine rank receive its own.
"""

from __future__ import annotations

import torch

from warmlink.errors import ConfigError

__all__ = ["BLOCK", "FP8_MAX", "block_fp8", "dequantize_block_fp8"]

BLOCK = (128, 128)
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_AMAX = 1e-4  # a block of zeros gets this amax: its scale stays finite and its values 0


def _check(weight: torch.Tensor, block: tuple[int, int]) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ConfigError(f"block_fp8: weight must be a 2-D tensor; got {type(weight).__name__} "
                          f"{tuple(getattr(weight, 'shape', ()))}")
    if not weight.is_floating_point() or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ConfigError(f"block_fp8: weight.dtype={weight.dtype}; expected a BF16, FP16 or float32 weight")
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise ConfigError(f"block_fp8: block={block!r}; expected two positive ints")


def block_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, weight_scale_inv)``: ``weight`` ``[N, K]`` as float8_e4m3fn ``[N, K]`` and its
    float32 scales ``[ceil(N / bn), ceil(K / bk)]`` (``block = (bn, bk)``), on ``weight``'s device.

    Raises:
        ConfigError: not a 2-D floating-point weight, or a bad block.
    """
    _check(weight, block)
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    # zeros past the edge add nothing to a block's amax, and their quantized values are cut off
    padded = torch.zeros(rows * bn, cols * bk, dtype=weight.dtype, device=weight.device)
    padded[:n, :k] = weight
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=_MIN_AMAX)
    scale = amax / FP8_MAX
    values = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    return values.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale.view(rows, cols)


def dequantize_block_fp8(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an engine computes with: each block of ``values`` times its ``scale_inv``."""
    n, k = values.shape
    bn, bk = block
    scales = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (values.float() * scales).to(dtype)
