"""The forms of ``x`` DeepEP's dispatch takes and returns, onto the one warmlink's Buffer carries.

warmlink's dispatch takes BF16 rows or an FP8 pair with float32 scales, one per 128 channels, and
returns ``recv_x`` as a view of its receive area, which the next dispatch overwrites. DeepEP
returns fresh tensors, and its FP8 scales may also come as UE8M0 exponents packed four to an
int32 (DeepGEMM's format on Blackwell). So the way in packs those int32 words, bit for bit, into
the first columns of the float32 scales warmlink carries (the rest zero), and the way out copies
``recv_x`` and takes the int32 words back out.
"""

from __future__ import annotations

import torch

from warmlink.ep.wire.fp8 import num_scales
from warmlink.errors import ConfigError

__all__ = ["pack_scales", "unpack_scales"]


def pack_scales(x, func: str):
    """``(x for warmlink's dispatch, packed int32 columns or 0)``."""
    if not isinstance(x, tuple) or len(x) != 2 or not isinstance(x[1], torch.Tensor) or x[1].dtype != torch.int32:
        return x, 0  # BF16, float32 scales, or something warmlink's own checks refuse by name
    values, words = x
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or words.dim() != 2:
        raise ConfigError(f"{func}: an FP8 x must be ([T, hidden] float8_e4m3fn, [T, S] scales); got shapes "
                          f"{tuple(getattr(values, 'shape', ()))} and {tuple(words.shape)}")
    full = num_scales(values.shape[1])
    cols = -(-full // 4)  # four UE8M0 exponents per int32
    if tuple(words.shape) != (values.shape[0], cols):
        raise ConfigError(f"{func}: packed UE8M0 scales of shape {tuple(words.shape)}; expected [{values.shape[0]}, {cols}] "
                          f"int32 (ceil({full} scales / 4)) for hidden={values.shape[1]}")
    carried = torch.zeros(values.shape[0], full, dtype=torch.int32, device=words.device)
    carried[:, :cols] = words  # integer copy: every bit of the exponents stays as it was
    return (values, carried.view(torch.float32)), cols


def unpack_scales(recv_x, packed_cols: int, fresh: bool = False):
    """DeepEP's ``recv_x`` from warmlink's: fresh tensors (``fresh``: ``recv_x`` is one already,
    not a view of the receive area), the packed int32 scales taken back out."""
    if not isinstance(recv_x, tuple):
        return recv_x if fresh else recv_x.clone()
    values, scales = recv_x
    if packed_cols:
        scales = scales.view(torch.int32)[:, :packed_cols].contiguous()
    return (values if fresh else values.clone()), scales  # the scales are already a fresh tensor of warmlink's unpack
