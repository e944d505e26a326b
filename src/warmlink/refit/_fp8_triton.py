"""The block FP8 quantizer on a GPU: one Triton program per 128 x 128 block.

Each program reads its block of the weight once, takes its amax, and writes the block's FP8 values
and its scale: one read of two bytes and one write of one byte per element, the least a quantizer
can move. The arithmetic is ``refit._fp8_math``'s block formula as torch runs it on CUDA (Note
[FP8 formulas] in ``refit.fp8``): ``scale = max(amax, 1e-4) * float32(1 / 448)`` (CUDA's torch
divides by a Python float so), ``1 / scale`` correctly rounded (``torch.reciprocal``), values
``x * (1 / scale)`` in float32 cast to e4m3 with round to nearest even (the hardware's ``cvt.rn``).
Imported only where Triton imports (``refit.quantize`` falls back to torch ops otherwise).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from warmlink.refit._fp8_layout import BLOCK, FP8_MAX
from warmlink.refit._fp8_math import MIN_BLOCK_AMAX

__all__ = ["block_fp8_"]

# float32(1 / 448), the reciprocal CUDA's torch multiplies by for ``amax / 448.0``
_INV_FP8_MAX = (torch.tensor(1.0, dtype=torch.float32, device="cpu") / torch.tensor(FP8_MAX, dtype=torch.float32,
                                                                                      device="cpu")).item()


@triton.jit
def _block_fp8_kernel(x_ptr, q_ptr, s_ptr, num_rows, num_cols,
                      sx0, sx1, sx2, sq0, sq1, sq2, ss0, ss1, ss2,
                      inv_fp8_max, min_amax, BN: tl.constexpr, BK: tl.constexpr):
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = (bi * BN + tl.arange(0, BN)).to(tl.int64)
    cols = (bj * BK + tl.arange(0, BK)).to(tl.int64)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < num_cols)
    x = tl.load(x_ptr + e * sx0 + rows[:, None] * sx1 + cols[None, :] * sx2, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.maximum(amax, min_amax) * inv_fp8_max
    inv = tl.math.div_rn(1.0, scale)
    tl.store(q_ptr + e * sq0 + rows[:, None] * sq1 + cols[None, :] * sq2, (x * inv).to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + e * ss0 + bi * ss1 + bj * ss2, scale)


def block_fp8_(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``x`` ``(*lead, R, C)`` (CUDA, BF16/FP16/float32, any strides), whose first row and
    column sit on the 128 x 128 grid, into ``values`` (its shape, float8_e4m3fn) and ``scales``
    ``(*lead, ceil(R / 128), ceil(C / 128))`` (float32); both written in place, on the current stream
    of ``x``'s device."""
    r, c = x.shape[-2:]
    x3 = x.reshape(-1, r, c)
    q3 = values.view(-1, r, c)
    s3 = scales.view(-1, *scales.shape[-2:])
    grid = (triton.cdiv(r, BLOCK[0]), triton.cdiv(c, BLOCK[1]), x3.shape[0])
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # CPU: Triton's interpreter
        _block_fp8_kernel[grid](x3, q3, s3, r, c, *x3.stride(), *q3.stride(), *s3.stride(), _INV_FP8_MAX,
                                MIN_BLOCK_AMAX, BN=BLOCK[0], BK=BLOCK[1], num_warps=8)
