"""FP8 (e4m3) tokens with one float32 scale per 128 channels, the format DeepEP dispatches.

A token row ``x[t]`` of ``hidden`` channels becomes ``(q[t], s[t])``: ``q`` is ``float8_e4m3fn``
``[hidden]`` and ``s`` is float32 ``[ceil(hidden / 128)]``, with ``x[t, j] ~= q[t, j] * s[t, j // 128]``.
"""

from __future__ import annotations

import torch

from warmlink.errors import ConfigError

__all__ = ["FP8_BLOCK", "FP8_MAX", "dequantize", "num_scales", "quantize"]

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def num_scales(hidden: int) -> int:
    """Scales per token of ``hidden`` channels: one per 128, the last block possibly partial
    (DeepEP pads the last block with zeros: gpt-oss's 2880 channels have 23 scales)."""
    return -(-hidden // FP8_BLOCK)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H]`` float tensor -> ``(float8_e4m3fn [T, H], float32 scales [T, num_scales(H)])``.

    A last block of fewer than 128 channels is scaled as if padded with zeros, as DeepEP does.

    Raises:
        ConfigError: ``x`` is not 2-D.
    """
    if x.dim() != 2:
        raise ConfigError(f"fp8.quantize: x.shape={tuple(x.shape)}; expected [tokens, hidden]")
    t, h = x.shape
    blocks = _blocks(x.float())
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / FP8_MAX
    q = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, blocks.shape[1] * FP8_BLOCK)[:, :h]
    return q.contiguous(), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of ``quantize`` (up to FP8 rounding)."""
    t, h = q.shape
    blocks = _blocks(q.float())
    return (blocks * scales.unsqueeze(2)).view(t, blocks.shape[1] * FP8_BLOCK)[:, :h].to(dtype)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` float32 as ``[T, num_scales(H), 128]``, the last block padded with zeros."""
    t, h = x.shape
    pad = num_scales(h) * FP8_BLOCK - h
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(t, num_scales(h), FP8_BLOCK)
