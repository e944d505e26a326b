"""The compiled check of a fresh dispatch's tensors (``host.cpp``'s ``fresh_accepts``, ep.protocol.checks)
on CPU tensors: whatever the arguments, ``Checks.dispatch`` with it gives what the Python checks give
alone (the same tensors, the same config word, or the same ConfigError), and the common kinds of
call are accepted by it, so that the checks' Python does not run for them. Built here by the
machine's C++ compiler (skipped only where there is none)."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.ep.protocol.checks import KIND_EXPERTS, Checks
from warmlink.errors import ConfigError

R, E, K, T, HIDDEN, MAX_TOKENS, MAX_TOPK = 2, 8, 3, 5, 256, 8, 4
LAYOUT = types.SimpleNamespace(hidden=HIDDEN, max_tokens=MAX_TOKENS, num_topk=MAX_TOPK)


def _base(fp8: bool = False, column_major_scales: bool = False, weights: bool = True) -> dict:
    """A fresh dispatch's arguments that every check passes (get_dispatch_layout's outputs as it
    returns them: int32 counts, bool in-rank)."""
    topk = torch.randint(-1, E, (T, K), dtype=torch.int64)
    if fp8:
        scales = torch.rand(T, HIDDEN // 128)
        x = (torch.randn(T, HIDDEN).to(torch.float8_e4m3fn), scales.T.contiguous().T if column_major_scales else scales)
    else:
        x = torch.randn(T, HIDDEN, dtype=torch.bfloat16)
    return {"x": x, "expert_alignment": 1, "num_worst_tokens": 0, "topk_idx": topk,
            "topk_weights": torch.rand(T, K) if weights else None, "num_experts": None,
            "per_rank": torch.zeros(R, dtype=torch.int32), "in_rank": torch.zeros(T, R, dtype=torch.bool),
            "per_expert": torch.zeros(E, dtype=torch.int32)}


def _dispatch(checks: Checks, args: dict):
    try:
        return checks.dispatch(args["x"], False, args["expert_alignment"], args["num_worst_tokens"], args["topk_idx"],
                               args["topk_weights"], args["num_experts"], args["per_rank"], args["in_rank"],
                               args["per_expert"], True)
    except ConfigError as exc:
        return exc


def _equal(u, v) -> bool:
    """The same tensor, or copies of one (a check makes a contiguous copy of x, ids, weights)."""
    if not isinstance(u, torch.Tensor) or u is v:
        return u is v or u == v
    return (isinstance(v, torch.Tensor) and u.dtype == v.dtype and u.shape == v.shape and u.device == v.device
            and torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)))


def _same(a, b) -> bool:
    """The same error, or the same checked arguments (but the kind: the Python checks give none)."""
    if isinstance(a, ConfigError) or isinstance(b, ConfigError):
        return type(a) is type(b) and str(a) == str(b)
    return all(_equal(u, v) for u, v in zip(a[:-1], b[:-1], strict=True)) and not b.kind


def _with(compiled) -> tuple[Checks, list]:
    """Checks offering fresh dispatches to the compiled check, and the list of its answers."""
    answers = []

    def accepts(*args):
        answers.append(compiled.fresh_accepts(*args))
        return answers[-1]

    checks = Checks(LAYOUT, R, -1)
    checks.compiled(accepts)
    return checks, answers


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8 column-major scales", "bf16 without weights"])
def test_the_common_calls_are_accepted_by_the_compiled_check_as_the_python_checks_accept_them(compiled, kind):
    args = _base(fp8=kind.startswith("fp8"), column_major_scales="column" in kind, weights="without" not in kind)
    checks, answers = _with(compiled)
    fast, slow = _dispatch(checks, args), _dispatch(Checks(LAYOUT, R, -1), args)
    assert len(answers) == 1 and answers[0] & KIND_EXPERTS == E and not isinstance(fast, ConfigError)
    assert _same(fast, slow) and fast.kind == answers[0]
    assert fast.tokens is (args["x"][0] if isinstance(args["x"], tuple) else args["x"]) and fast.num_experts == E


def test_calls_of_one_kind_share_it_and_other_kinds_differ(compiled):
    """The kind names what the launches of a call are packed for (ep.paths.planned): the same for
    calls that differ in their tensors' values, addresses and scale strides alone."""
    checks = _with(compiled)[0]
    kinds = {}
    for name, args in {"bf16": _base(), "bf16 again": _base(), "fp8": _base(fp8=True),
                       "fp8 column-major": _base(fp8=True, column_major_scales=True),
                       "no weights": _base(weights=False),
                       "int32 ids": {**_base(), "topk_idx": torch.zeros(T, K, dtype=torch.int32)},
                       "two ids": {**_base(), "topk_idx": torch.zeros(T, 2, dtype=torch.int64),
                                   "topk_weights": torch.rand(T, 2)},
                       "int64 counts": {**_base(), "per_rank": torch.zeros(R, dtype=torch.int64)}}.items():
        kinds[name] = _dispatch(checks, args).kind
    assert kinds["bf16"] == kinds["bf16 again"] and kinds["fp8"] == kinds["fp8 column-major"]
    others = [k for name, k in kinds.items() if name not in ("bf16 again", "fp8 column-major")]
    assert len(set(others)) == len(others) and all(k & KIND_EXPERTS == E for k in others)


def _tensor_variants(name: str, t: torch.Tensor | None):
    """Ways to spoil one tensor argument (or leave it as it is)."""
    if t is None:
        return st.sampled_from([None, torch.rand(T, K)])
    dtypes = [torch.int64, torch.int32, torch.int16, torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.uint8]
    return st.one_of(
        st.just(t),
        st.sampled_from(dtypes).map(lambda d: t.to(d)),
        st.just(t.T.contiguous().T if t.dim() == 2 else t),  # same shape, other strides
        st.just(t[:-1] if t.shape[0] else t),
        st.just(t.unsqueeze(0)),
        st.just(torch.empty(t.shape, dtype=t.dtype, device="meta")),  # another device
        st.just(t.reshape(-1)[:1].expand(t.shape) if t.numel() else t),  # broadcast: not contiguous
        st.just(torch.cat([t, t], dim=-1) if t.dim() else t),
        st.sampled_from([None, [1, 2], 3]),
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_with_the_compiled_check_every_call_gives_what_the_python_checks_give(compiled, data):
    fp8 = data.draw(st.booleans(), "fp8")
    args = _base(fp8=fp8, column_major_scales=data.draw(st.booleans(), "column-major"))
    spoiled = data.draw(st.sets(st.sampled_from(["x", "scales", "topk_idx", "topk_weights", "per_rank", "in_rank",
                                                 "per_expert", "ints", "x form"]), max_size=2), "spoiled")
    for name in ("topk_idx", "topk_weights", "per_rank", "in_rank", "per_expert"):
        if name in spoiled:
            args[name] = data.draw(_tensor_variants(name, args[name]), name)
    values, scales = args["x"] if fp8 else (args["x"], None)
    if "x" in spoiled:
        values = data.draw(_tensor_variants("x", values), "x")
    if "scales" in spoiled and fp8:
        scales = data.draw(_tensor_variants("scales", scales), "scales")
    args["x"] = (values, scales) if fp8 else values
    if "x form" in spoiled:
        args["x"] = data.draw(st.sampled_from([(values,), (values, scales, scales), [values, scales], (values, None)]))
    if "ints" in spoiled:
        args["expert_alignment"] = data.draw(st.sampled_from([1, 2, 0, True, 1.0]), "expert_alignment")
        args["num_worst_tokens"] = data.draw(st.sampled_from([0, 3, R * MAX_TOKENS, R * MAX_TOKENS + 1, -1, False]))
        args["num_experts"] = data.draw(st.sampled_from([None, E, E - 2, 0, 7, "8"]), "num_experts")
    checks, answers = _with(compiled)
    fast, slow = _dispatch(checks, args), _dispatch(Checks(LAYOUT, R, -1), args)
    assert _same(fast, slow), (fast, slow)
    if answers and answers[-1]:  # accepted by it: accepted by the checks, the tensors given back as they came
        assert not isinstance(slow, ConfigError)
        assert all(u is v for u, v in zip(fast, slow) if isinstance(u, torch.Tensor))
