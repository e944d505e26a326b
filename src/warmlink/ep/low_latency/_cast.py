"""FP8 casts of low-latency dispatch: per-128-channel scales, rounded to powers of two on request,
and DeepEP's UE8M0 packing. Plain torch ops: the same on the host and on a device.

A token ``x[t]`` becomes ``q[t] = x[t] / s`` in ``float8_e4m3fn`` with one float32 scale ``s`` per
128 channels, ``s = amax / 448`` (``amax`` the block's largest magnitude, at least 1e-4, as
DeepEP's kernels clamp it). ``round_scale`` rounds ``s`` up to a power of two (``2 ** ceil(log2
(amax / 448))``), so ``q`` still fits; UE8M0 keeps only that power's biased exponent, one byte,
four of them packed little-endian in an int32 (byte ``j`` of word ``w`` is block ``4 w + j``).
"""

from __future__ import annotations

import torch

from warmlink.ep.wire.fp8 import FP8_BLOCK, FP8_MAX

__all__ = ["cast_fp8", "pack_ue8m0"]

_AMAX_FLOOR = 1e-4


def cast_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, H]`` BF16 -> ``(float8_e4m3fn [N, H], float32 scales [N, H // 128])`` (new tensors)."""
    n, h = x.shape
    blocks = x.float().view(n, h // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=_AMAX_FLOOR)
    scales = amax / FP8_MAX
    if round_scale:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    q = (blocks / scales.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(n, h)
    return q, scales


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, S]`` powers of two -> int32 ``[N, ceil(S / 4)]`` of their biased exponents."""
    n, s = scales.shape
    exponents = (scales.view(torch.int32) >> 23) & 0xFF
    words = -(-s // 4)
    padded = torch.zeros(n, words * 4, dtype=torch.uint8, device=scales.device)
    padded[:, :s] = exponents.to(torch.uint8)
    return padded.view(torch.int32)
