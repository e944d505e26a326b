"""Arguments of low-latency calls for Hypothesis, on CPU tensors of a small layout: mostly the
common call, sometimes a tensor of another dtype, shape or layout, flags of other types, or
statistics tensors (the quick acceptance's tests, tests/ep/test_ll_accepts.py and
test_ll_launch_made.py)."""

from __future__ import annotations

import types

import torch
from hypothesis import strategies as st

from warmlink.ep.low_latency._layout import LowLatencyLayout

R, T, HIDDEN, E, K = 2, 8, 256, 8, 4
LAYOUT = LowLatencyLayout(R, T, HIDDEN, E, K)


def tensor(draw, shape: tuple, dtype) -> torch.Tensor:
    """A tensor of ``shape``, maybe of another dtype, shape or layout than asked."""
    fault = draw(st.sampled_from(["none"] * 6 + ["dtype", "shape", "dims", "strided", "subclass"]))
    if fault == "dtype":
        dtype = draw(st.sampled_from([torch.float16, torch.int64, torch.int32, torch.float32, torch.bfloat16]))
    if fault == "shape":
        shape = tuple(max(0, d + draw(st.integers(-1, 1))) for d in shape)
    if fault == "dims":
        shape = (*shape, 1) if draw(st.booleans()) else shape[1:]
    t = torch.zeros(shape, dtype=torch.float32).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
    if fault == "strided" and t.dim() >= 1 and t.shape[-1] > 1:
        t = torch.zeros((*shape[:-1], shape[-1] * 2), dtype=dtype)[..., ::2]
    if fault == "subclass":
        t = torch.nn.Parameter(t, requires_grad=False)
    return t


flag = st.sampled_from([True, False, True, False, 1, 0, None])


def stats(draw, shape: tuple, dtype) -> torch.Tensor | None:
    """A statistics argument: None (most calls) or a tensor, maybe of another kind than asked."""
    return None if draw(st.booleans()) else tensor(draw, shape, dtype)


@st.composite
def dispatch_args(draw):
    n = draw(st.integers(0, T + 1))
    cols = draw(st.integers(0, K + 1))
    tokens = draw(st.sampled_from([T, T - 1, n, 0, T + 1, True, float(T)]))
    return (tensor(draw, (n, HIDDEN), torch.bfloat16),
            tensor(draw, (n, cols), draw(st.sampled_from([torch.int64, torch.int32]))),
            tokens, draw(st.sampled_from([E, E - R, E + 0.0])), draw(flag), draw(flag), draw(flag), draw(flag),
            draw(flag), stats(draw, (E // R,), torch.int32), stats(draw, (R,), torch.int64))


@st.composite
def combine_args(draw):
    tokens = draw(st.integers(1, T))
    n = draw(st.integers(0, tokens))
    cols = draw(st.integers(1, K))
    handle = types.SimpleNamespace(num_tokens=n, num_topk=cols, num_max_dispatch_tokens_per_rank=tokens,
                                   dispatched=torch.ones(n, cols, dtype=torch.bool))
    out = draw(st.sampled_from([None, "tensor"]))
    return (tensor(draw, (E // R, R * tokens, HIDDEN), torch.bfloat16),
            tensor(draw, (n, cols), draw(st.sampled_from([torch.int64, torch.int32]))),
            tensor(draw, (n, cols), torch.float32), handle, draw(st.sampled_from([False, False, True, 0])),
            draw(flag), draw(flag), draw(flag),
            None if out is None else tensor(draw, (n, HIDDEN), torch.bfloat16), stats(draw, (R,), torch.int64))
