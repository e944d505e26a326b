"""Helpers of the DeepEP-style tests, written for them: DeepEP's test utilities in behaviour (FP8
casts per 128-channel block with a partial last block, UE8M0 scales packed four to an int32, the
similarity measure its checks use, top-k ranks made unique), without its torch.compile."""

from __future__ import annotations

import torch

_BLOCK, _FP8_MAX = 128, 448.0


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``[T, ceil(H / 128), 128]`` float32 view of x, the last block zero-padded."""
    t, h = x.shape
    padded = torch.zeros(t, -(-h // _BLOCK) * _BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :h] = x.float()
    return padded.view(t, -1, _BLOCK)


def per_token_cast_to_fp8(x: torch.Tensor, ue8m0: bool = False):
    """``(float8_e4m3fn [T, H], scales)``: float32 ``[T, ceil(H / 128)]`` scales, or with ``ue8m0``
    power-of-two scales as exponent bytes packed four to an int32 ``[T, ceil(ceil(H / 128) / 4)]``."""
    t, h = x.shape
    blocks = _blocks(x)
    scales = blocks.abs().amax(dim=2).clamp(min=1e-4) / _FP8_MAX
    if ue8m0:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    q = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, -1)[:, :h].contiguous()
    if not ue8m0:
        return q, scales
    exponents = (scales.view(torch.int32) >> 23).to(torch.uint8)  # a power of two is its exponent byte
    cols = -(-exponents.shape[1] // 4)
    packed = torch.zeros(t, cols * 4, dtype=torch.uint8, device=x.device)
    packed[:, :exponents.shape[1]] = exponents
    return q, packed.view(torch.int32)


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """BF16 ``[T, H]`` from ``per_token_cast_to_fp8``'s output (either scale form)."""
    t, h = q.shape
    num_blocks = -(-h // _BLOCK)
    if scales.dtype == torch.int32:
        exponents = scales.contiguous().view(torch.uint8)[:, :num_blocks].to(torch.int32) << 23
        scales = exponents.view(torch.float32)
    blocks = _blocks(q.float())[:, :num_blocks] * scales.reshape(t, num_blocks, 1)
    return blocks.reshape(t, -1)[:, :h].to(torch.bfloat16)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's closeness measure: 0 for equal tensors, ``1 - cos``-like otherwise (values shifted by 1)."""
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Each row of ``x`` (values in ``[-1, num_slots)``) becomes its distinct values, largest
    first, then -1s."""
    present = torch.zeros(x.shape[0], num_slots + 1, dtype=torch.bool, device=x.device)
    present.scatter_(1, x.masked_fill(x < 0, num_slots), True)
    present = present[:, :num_slots]
    slots = torch.arange(num_slots, device=x.device, dtype=x.dtype).expand_as(present)
    ordered = torch.where(present, slots, -1).sort(dim=1, descending=True).values
    x.fill_(-1)
    width = min(num_slots, x.shape[1])
    x[:, :width] = ordered[:, :width]
