"""FP8 formats (warmlink.refit.fp8): values and scales of each scheme against vLLM's formulas as
written in ``_fp8_reference`` (and vLLM's own quantizer in tests/integrations/test_vllm.py where
vLLM is installed), shards that quantize as their part of the whole, scale layouts, refusals."""

from __future__ import annotations

import pytest
import torch

from _fp8_reference import REF
from warmlink.errors import ConfigError, LayoutError
from warmlink.refit import TensorLayout
from warmlink.refit.fp8 import BLOCK, FP8_MAX, Fp8, block_fp8, dequantize, quantize, scale_layout
from warmlink.refit.manifest import Part, Shard


def _weight(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = shape[-2]
    scales = torch.logspace(-3, 1, n, dtype=torch.float32)[torch.randperm(n, generator=gen)]  # rows of every magnitude
    return (torch.randn(shape, generator=gen) * scales[:, None]).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (576, 128), (1, 1)])
def test_values_and_scales_equal_vllms_formulas(scheme, shape):
    w = _weight(*shape)
    values, scales = quantize(w, scheme)
    want_values, want_scales = REF[scheme](w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == w.shape and scales.dtype == torch.float32
    assert torch.equal(_bits(values), _bits(want_values)) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_stacked_experts_quantize_expert_by_expert(scheme):
    w = _weight(3, 300, 260, seed=4)
    values, scales = quantize(w, scheme)
    for e in range(3):
        v, s = REF[scheme](w[e])
        assert torch.equal(_bits(values[e]), _bits(v)) and torch.equal(scales[e], s)


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
def test_dequantized_weights_are_within_half_a_step_of_the_originals(scheme):
    w = _weight(384, 512, seed=1)
    values, scales = quantize(w, scheme)
    back = dequantize(values, scales, scheme)
    step = (scales.repeat_interleave(128, 0).repeat_interleave(128, 1) if scheme == "block" else scales)
    # e4m3 has 3 mantissa bits: half a step of the top binade [256, 448] is 16 x scale
    assert ((back - w.float()).abs() <= 16 * step * (1 + 1e-4)).all()  # a tie sits at 16 x scale exactly
    assert values.float().abs().amax() <= FP8_MAX and not torch.isnan(values.float()).any()


@pytest.mark.parametrize("dim", [0, 1])
def test_a_block_shard_cut_at_128_quantizes_as_its_part_of_the_whole(dim):
    """TP 2 of a column- (dim 0) or row-parallel (dim 1) layer: each rank's shard, quantized alone,
    is its slice of the whole tensor's values and scales, bit for bit."""
    w = _weight(512, 768, seed=2)
    values, scales = block_fp8(w)
    for rank, shard in enumerate(w.chunk(2, dim)):
        v, s = block_fp8(shard)
        assert torch.equal(_bits(v), _bits(values.chunk(2, dim)[rank]))
        assert torch.equal(s, scales.chunk(2, dim)[rank])


def test_a_block_of_zeros_gets_a_finite_scale_and_zeros():
    w = torch.zeros(128, 256, dtype=torch.bfloat16)
    w[:, 128:] = 1.0
    values, scales = block_fp8(w)
    assert scales.tolist() == [[pytest.approx(1e-4 / FP8_MAX), pytest.approx(1.0 / FP8_MAX)]]
    assert (values[:, :128].float() == 0).all() and (values[:, 128:].float() == FP8_MAX).all()


@pytest.mark.parametrize("weight,scheme,match", [
    (torch.zeros(4), "block", "2 or more dims"),
    (torch.zeros(2, 4, 4), "tensor", "tensor of 2 dims"),
    (torch.zeros(4, 4, dtype=torch.int32), "block", "weight.dtype=torch.int32"),
    (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "block", "float8_e4m3fn"),
    (torch.zeros(4, 4), "fp4", "scheme='fp4' is unknown"),
])
def test_bad_weights_and_schemes_are_refused_naming_them(weight, scheme, match):
    with pytest.raises(ConfigError, match=match):
        quantize(weight, scheme)


def test_block_fp8_takes_only_vllms_block():
    with pytest.raises(ConfigError, match=r"block=\(64, 128\)"):
        block_fp8(torch.zeros(4, 4), (64, 128))
    assert BLOCK == (128, 128)


# -- scale layouts -------------------------------------------------------------------------------
def test_scale_layouts_of_a_fused_qkv_follow_vllms_parameters():
    """vLLM's QKVParallelLinear at TP 2 with q 512 / k, v 256 rows and hidden 320: weight_scale_inv
    [ceil(256/128) + 1 + 1, ceil(320/128)], each partition's block rows at its rows / 128;
    weight_scale [256 + 128 + 128, 1] per row; per-tensor [3], one per partition."""
    q, k = Shard.split((512, 320), 0, 2, 1), Shard.split((256, 320), 0, 2, 1)
    qkv = TensorLayout.fused("qkv", "bfloat16", [("q", q), ("k", k), ("v", k)])
    block = scale_layout(qkv, "block")
    assert block.name == "qkv_scale_inv" and block.shape == (4, 3) and block.dtype == "float32"
    assert [(p.logical, p.shard.global_shape, p.shard.bounds, p.offset) for p in block.parts] == [
        ("q_scale_inv", (4, 3), ((2, 4), (0, 3)), (0, 0)),
        ("k_scale_inv", (2, 3), ((1, 2), (0, 3)), (2, 0)),
        ("v_scale_inv", (2, 3), ((1, 2), (0, 3)), (3, 0))]
    channel = scale_layout(qkv, "channel")
    assert channel.name == "qkv_scale" and channel.shape == (512, 1)
    assert [(p.shard.bounds, p.offset) for p in channel.parts] == [(((256, 512), (0, 1)), (0, 0)),
                                                                    (((128, 256), (0, 1)), (256, 0)),
                                                                    (((128, 256), (0, 1)), (384, 0))]
    tensor = scale_layout(qkv, "tensor")
    assert tensor.shape == (3,) and [(p.logical, p.offset) for p in tensor.parts] == [
        ("q_scale", (0,)), ("k_scale", (1,)), ("v_scale", (2,))]


def test_a_part_that_splits_cells_gets_replicated_scales():
    """A shard cut mid-block (or mid-row) shares its edge cells with another rank: its scale part is
    marked replicated, so that a plan accepts both holders (they hold the same scales once reduced)."""
    lay = TensorLayout.plain("o", "bfloat16", (320, 512), split_dim=0, num_shards=2, shard_idx=1)  # rows 160..320
    (p,) = scale_layout(lay, "block").parts
    assert p.shard.bounds == ((1, 3), (0, 4)) and p.replicated
    row = TensorLayout.plain("d", "bfloat16", (320, 512), split_dim=1, num_shards=2, shard_idx=0)
    assert scale_layout(row, "channel").parts[0].replicated and not scale_layout(row, "block").parts[0].replicated


def test_scale_layouts_refuse_what_cannot_hold_scales():
    with pytest.raises(LayoutError, match=r"places logical='b' at offset=\(100, 0\)"):
        scale_layout(TensorLayout.fused("ab", "bfloat16", [("a", Shard((100, 128))), ("b", Shard((128, 128)))]), "block")
    with pytest.raises(LayoutError, match="expected an untransposed weight"):
        scale_layout(TensorLayout("t", "bfloat16", (Part("w", Shard((128, 256)), (0, 0), (1, 0)),)), "block")
    with pytest.raises(LayoutError, match="2-D weight for scheme='tensor'"):
        scale_layout(TensorLayout.plain("e", "bfloat16", (2, 128, 128)), "tensor")


def test_fp8_spec_takes_names_not_a_string():
    with pytest.raises(ConfigError, match="collection of logical tensor names"):
        Fp8("block", logical="model.layers.0.mlp.down_proj.weight")
    assert Fp8("channel", logical=["a", "b"]).logical == frozenset({"a", "b"})
