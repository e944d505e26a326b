"""A reference FP8 quantizer written from vLLM 0.32's own formulas (never from warmlink's), and what
vLLM's loaders make of its output on each engine rank.

* block: ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (per expert for stacked experts, as
  ``Fp8MoEMethod`` checkpoints hold them): zero-pad to 128 x 128 blocks, ``amax`` in float32
  clamped to 1e-4, ``sf = amax / 448.0``, values ``(x * (1.0 / sf)).to(float8_e4m3fn)``.
* channel: ``Fp8PtpcOnlineLinearMethod``: ``weight_amax(w, dim=-1, keepdim=True)`` (``aminmax``),
  ``_fp8_channel_scale`` = ``(amax.float() / fp8_max).clamp_min(1.0 / (fp8_max * 512))`` with
  ``fp8_max`` a float32 tensor, values ``_fp8_quant_per_channel`` = ``(w / scale).clamp_(-448, 448)``.
* tensor: ``Fp8PerTensorOnlineLinearMethod``: ``_fp8_scale(weight_amax(w))`` and the static
  ``scaled_fp8_quant`` kernel (csrc ``scaled_fp8_conversion<true>``): ``inv = 1.0f / scale``,
  ``x = float(w) * inv`` clamped to +-448, converted.

The engine side: values and block scales go through ``ref_vllm`` (vLLM's loaders, written in
``_references``) like any weight: a block scale is sliced in block units where the weight is sliced
in rows (``BlockQuantScaleParameter``: ``shard_offset // block_n``). Channel scales of a
row-parallel layer load whole on every rank; per-tensor scales of a fused module load one per
partition (``PerTensorScaleParameter``: ``param[shard_id] = loaded``).
"""

from __future__ import annotations

import re

import torch

from _references import ref_vllm

FP8 = torch.float8_e4m3fn
SUFFIX = {"block": "_scale_inv", "channel": "_scale", "tensor": "_scale"}


def ref_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if w.dim() > 2:  # stacked experts: each expert its own weight
        pairs = [ref_block(x) for x in w]
        return torch.stack([v.view(torch.uint8) for v, _ in pairs]).view(FP8), torch.stack([s for _, s in pairs])
    m, n = w.shape
    padded = torch.zeros(-(-m // 128) * 128, -(-n // 128) * 128, dtype=w.dtype, device=w.device)
    padded[:m, :n] = w
    view = padded.view(-1, 128, padded.size(1) // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    values = (view * (1.0 / sf)).to(FP8)
    return values.view_as(padded)[:m, :n].contiguous(), sf.view(view.size(0), view.size(2))


def ref_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = w.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(lo.abs(), hi.abs())
    fp8_max = torch.tensor(448.0, dtype=torch.float32, device=w.device)
    scale = (amax.to(torch.float32) / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    return (w / scale).clamp_(-448.0, 448.0).to(FP8), scale


def ref_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = w.aminmax()
    fp8_max = torch.tensor(448.0, dtype=torch.float32, device=w.device)
    scale = (torch.maximum(lo.abs(), hi.abs()).to(torch.float32) / fp8_max).reshape(1)
    inv = torch.tensor(1.0, dtype=torch.float32, device=w.device) / scale
    return (w.float() * inv).clamp(-448.0, 448.0).to(FP8), scale


REF = {"block": ref_block, "channel": ref_channel, "tensor": ref_tensor}


def quantize_state(sd: dict, names, scheme: str) -> tuple[dict, dict]:
    """``(values, scales)`` by logical name: every tensor of ``names`` in ``sd`` quantized whole."""
    pairs = {n: REF[scheme](sd[n]) for n in names}
    return {n: v for n, (v, _) in pairs.items()}, {n: s for n, (_, s) in pairs.items()}


def vllm_fp8(cfg, sd: dict, names, scheme: str, tp: int, r: int, quantized: tuple | None = None) -> dict[str, torch.Tensor]:
    """What vLLM rank ``r`` of ``tp`` holds after loading a checkpoint of ``sd`` whose ``names``
    were quantized whole in ``scheme`` (``quantized``: ``quantize_state``'s result, if at hand):
    FP8 values under vLLM's weight names, scales beside them."""
    values, scales = quantized or quantize_state(sd, names, scheme)
    plain = {n: (values[n].view(torch.uint8) if n in values else t) for n, t in sd.items()}
    # uint8 only where FP8 values went in: those come out as vLLM's FP8 weights
    out = {n: (t.view(FP8) if t.dtype == torch.uint8 else t) for n, t in ref_vllm(cfg, plain, tp, r).items()}
    if scheme == "tensor":
        out.update(_tensor_scales(scales))
        return out
    if scheme == "channel":  # row-parallel layers load a [..., N, 1] scale whole: through ref_vllm as [..., N, tp]
        scales = {n: (s.expand(*s.shape[:-1], tp) if re.search(r"(o_proj\.weight|down_proj\.weight|experts\.down_proj)$", n)
                      else s) for n, s in scales.items()}
    for name, s in ref_vllm(cfg, scales, tp, r).items():
        out[name + SUFFIX[scheme]] = s.contiguous()
    return out


def _tensor_scales(scales: dict) -> dict[str, torch.Tensor]:
    """``weight_scale`` of each vLLM module of a dense model: one per partition, in its loader's
    shard order (the same on every rank: each partition's scale is of its whole weight)."""
    out = {}
    for name, s in scales.items():
        if m := re.match(r"(.*)\.self_attn\.q_proj\.weight$", name):
            out[f"{m[1]}.self_attn.qkv_proj.weight_scale"] = torch.cat([s, *(scales[f"{m[1]}.self_attn.{p}_proj.weight"]
                                                                              for p in "kv")])
        elif m := re.match(r"(.*)\.gate_proj\.weight$", name):
            out[f"{m[1]}.gate_up_proj.weight_scale"] = torch.cat([s, scales[f"{m[1]}.up_proj.weight"]])
        elif not re.search(r"self_attn\.[kv]_proj\.|\.up_proj\.", name):
            out[name + "_scale"] = s
    return out
