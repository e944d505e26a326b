"""``ep.wire.fp8``: DeepEP's per-128-channel FP8 format, also for hidden sizes that are not multiples of 128; and
FP8 dispatches over shm with scales of any strides (ep.kernels.steps, Note [Scales in place])."""

from __future__ import annotations

import pytest
import torch

from tests.ep._group import run_ranks
from tests.ep._reference import reference_dispatch
from tests.ep._workers import fp8_inputs, fp8_scale_layouts, scales_laid_out
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


# -- the scales' strides (ep.kernels.steps, Note [Scales in place]) --------------------------------------
def scale_layouts_case(num_ranks: int) -> dict:
    """Eight fresh FP8 dispatches with row-major, column-major (DeepEP's tests) and wider-view
    scales in turn and new token counts (0 and 1 among them), each re-sent with its handle (the
    fourth twice, so that fresh calls use both parities); hidden 2880: 23 scales, a partial block.
    On GPUs every parity's graph captured by one layout's call is replayed by the others'."""
    layouts = ("row", "column", "wider", "column", "row", "column", "row", "wider")
    rounds = [{"tokens": [(11 * i + 5 * r + 1) % 19 if (i, r) != (2, 0) else 0 for r in range(num_ranks)],
               "seed": 30 + i, "scales": layout, "cached": 2 if i == 3 else 1} for i, layout in enumerate(layouts)]
    rounds[5]["tokens"][-1] = 1
    return {"hidden": 2880, "experts": 4 * num_ranks, "topk": 3, "mask_prob": 0.1, "rounds_cases": rounds}


def check_scale_layouts(case: dict, results: list[list[dict]]) -> None:
    """Every call of ``_workers.fp8_scale_layouts`` received, bit for bit, the rows and scales the
    oracle sends from row-major inputs, whatever the layout of the scales sent; and every device
    step was given the caller's own scales (address and strides), never a copy."""
    for rnd, sub in enumerate(case["rounds_cases"]):
        inputs = [fp8_inputs(dict(case, **sub), s) for s in range(len(results))]
        ref = reference_dispatch([x for x, _ in inputs], [idx for _, idx in inputs], None, case["experts"])
        for d, want in enumerate(ref):
            values, scales = want["recv_x"]
            for call in (results[d][rnd]["fresh"], *results[d][rnd]["cached"]):
                where = f"rank {d} round {rnd} ({sub['scales']} scales)"
                assert torch.equal(call["x"][0].view(torch.uint8), values.view(torch.uint8)), where
                assert torch.equal(call["x"][1].view(torch.int32), scales.view(torch.int32)), where
                assert call["seen"] and all(tuple(s) == tuple(call["want"]) for s in call["seen"]), (where, call["want"], call["seen"])


def test_row_and_column_major_scales_arrive_bit_identical_and_are_never_copied():
    case = scale_layouts_case(2)
    check_scale_layouts(case, run_ranks(fp8_scale_layouts, 2, case=case, timeout_s=120))


def test_scales_of_another_dtype_or_shape_are_refused_by_name():
    """Any strides are read in place, but not another dtype or shape: ``ConfigError`` naming the
    problem, from a fresh dispatch (refused before any byte moves) and a cached one."""
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    case = {"tokens": [4], "seed": 3, "hidden": 256, "experts": 2, "topk": 2}
    (values, scales), idx = fp8_inputs(case, 0)
    bad = {r"FP8 x dtypes \(torch.float8_e4m3fn, torch.float64\)": scales.double(),
           r"FP8 x dtypes \(torch.float8_e4m3fn, torch.int32\)": scales.view(torch.int32),
           r"FP8 x shapes \(4, 256\), \(4, 3\); expected \[T, 256\] and \[T, 2\]": scales_laid_out(torch.ones(4, 3), "column"),
           r"x\[1\] has 3 rows; expected 4": scales_laid_out(scales[:3], "column"),
           r"x\[1\] must be a 2-D tensor": scales[:, 0]}
    store = Store(is_server=True, prefix="ep-fp8-scales", timeout_s=10)
    try:
        with Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=256, num_topk=2, timeout_s=10) as buf:
            for match, s in bad.items():
                with pytest.raises(ConfigError, match=match):
                    buf.dispatch((values, s), topk_idx=idx, num_experts=2)
            recv, *_, handle, _ = buf.dispatch((values, scales_laid_out(scales, "column")), topk_idx=idx, num_experts=2)
            assert torch.equal(recv[1].view(torch.int32), scales.view(torch.int32))
            for match, s in bad.items():
                with pytest.raises(ConfigError, match=match):
                    buf.dispatch((values, s), handle=handle)
    finally:
        store.close()
