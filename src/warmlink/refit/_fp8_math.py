"""FP8 arithmetic in torch ops, as vLLM writes it (Note [FP8 formulas] in ``refit.fp8``).

Each scheme is three steps over a *part*: a tensor ``x`` of shape ``(*lead, R, C)`` holding the box
of a weight whose last two dims start at ``(r0, c0)``:

* ``amax(x, r0, c0)``: the absolute maximum of each scale cell the part touches (float32, shaped
  as those cells), a partial cell's over the elements the part holds;
* ``scales_(amax)``: amaxes to scales, in place (after any reduction over ranks);
* ``quantize(x, scales, r0, c0, out)``: FP8 values into ``out`` (``x``'s shape), each element
  scaled by its cell's scale.

They run on whatever device ``x`` is on; the GPU path of the block scheme is a kernel
(``refit._fp8_triton``) that keeps the same arithmetic.
"""

from __future__ import annotations

import torch

from warmlink.refit._fp8_layout import BLOCK, FP8_MAX

__all__ = ["MIN_BLOCK_AMAX", "amax", "scales_", "quantize", "dequantize"]

MIN_BLOCK_AMAX = 1e-4  # per_block_cast_to_fp8's clamp: a block of zeros keeps a finite scale
_FP8 = torch.float8_e4m3fn


def _padded(x: torch.Tensor, r0: int, c0: int) -> tuple[torch.Tensor, int, int]:
    """``x`` placed in zeros aligned to the block grid (front padding ``r0 % 128``, ``c0 % 128``),
    seen as ``(*lead, rows, 128, cols, 128)``; zeros add nothing to an amax and are cut off after."""
    *lead, r, c = x.shape
    pr, pc = r0 % BLOCK[0], c0 % BLOCK[1]
    rows, cols = -(-(pr + r) // BLOCK[0]), -(-(pc + c) // BLOCK[1])
    if pr == 0 and pc == 0 and r == rows * BLOCK[0] and c == cols * BLOCK[1]:
        padded = x
    else:
        padded = torch.zeros(*lead, rows * BLOCK[0], cols * BLOCK[1], dtype=x.dtype, device=x.device)
        padded[..., pr:pr + r, pc:pc + c] = x
    return padded.view(*lead, rows, BLOCK[0], cols, BLOCK[1]), pr, pc


def amax(x: torch.Tensor, scheme: str, r0: int = 0, c0: int = 0) -> torch.Tensor:
    """Per-cell absolute maxima of part ``x`` (see the module docstring), float32."""
    if scheme == "block":
        blocks, _, _ = _padded(x, r0, c0)
        return blocks.abs().float().amax(dim=(-3, -1))
    if scheme == "channel":
        return x.abs().amax(dim=-1, keepdim=True).float()
    return x.abs().amax().float().reshape(1)


def scales_(cells: torch.Tensor, scheme: str) -> torch.Tensor:
    """Amaxes to scales, in place: block ``max(amax, 1e-4) / 448`` (``per_block_cast_to_fp8``: a
    division by a Python float, which CUDA runs as a multiplication by its reciprocal); channel
    ``max(amax / 448, 1 / (448 * 512))`` and tensor ``amax / 448``, divisions by a float32 tensor
    (vLLM's online methods' ``_fp8_scale``, ``_fp8_channel_scale``)."""
    if scheme == "block":
        return cells.clamp_(min=MIN_BLOCK_AMAX).div_(FP8_MAX)
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=cells.device)
    cells.div_(fp8_max)
    if scheme == "channel":
        cells.clamp_(min=1.0 / (fp8_max * 512))
    return cells


def quantize(x: torch.Tensor, scales: torch.Tensor, scheme: str, out: torch.Tensor, r0: int = 0, c0: int = 0) -> None:
    """FP8 values of part ``x`` into ``out`` (same shape, float8_e4m3fn), given its cells' ``scales``
    (shaped as ``amax`` returns them): block ``x * (1 / scale)`` cast (``per_block_cast_to_fp8``);
    channel ``x / scale`` clamped to +-448 (``_fp8_quant_per_channel``); tensor ``x * (1 / scale)``
    in float32 clamped to +-448 (the static ``scaled_fp8_quant`` kernel's ``scaled_fp8_conversion``)."""
    if scheme == "block":
        blocks, pr, pc = _padded(x, r0, c0)
        *lead, rows, bn, cols, bk = blocks.shape
        values = (blocks * (1.0 / scales[..., :, None, :, None])).to(_FP8)
        out.copy_(values.view(*lead, rows * bn, cols * bk)[..., pr:pr + x.shape[-2], pc:pc + x.shape[-1]])
    elif scheme == "channel":
        out.copy_((x / scales).clamp_(-FP8_MAX, FP8_MAX).to(_FP8))
    else:
        out.copy_((x.float() * torch.reciprocal(scales)).clamp_(-FP8_MAX, FP8_MAX).to(_FP8))


def dequantize(values: torch.Tensor, scales: torch.Tensor, scheme: str, dtype=torch.float32) -> torch.Tensor:
    """The weight an engine computes with: each element of ``values`` times its cell's scale."""
    if scheme == "block":
        *_, n, k = values.shape
        scales = scales.repeat_interleave(BLOCK[0], -2)[..., :n, :].repeat_interleave(BLOCK[1], -1)[..., :k]
    return (values.float() * scales).to(dtype)
