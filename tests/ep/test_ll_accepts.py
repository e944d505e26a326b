"""The quick acceptance of a low-latency call's arguments (``LowLatencyChecks.accepts_dispatch`` and
``accepts_combine``, ep.low_latency._checks; its tensors checked by ep.kernels.host's compiled
``ll_*_accepts``, or in Python without them) on CPU tensors: whatever the arguments, the checks
with it give what the full checks give alone (the same tensors, or the same ConfigError), and the
common call of the device path is accepted by it, so that the full checks' Python does not run
for it."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings

from tests.ep._ll_call_args import HIDDEN, LAYOUT, E, K, R, T, combine_args, dispatch_args
from warmlink.ep.low_latency._checks import LowLatencyChecks
from warmlink.errors import ConfigError


def _answer(checks: LowLatencyChecks, call: str, *args):
    """The checks' answer: the tensors they return, or the ConfigError they raise."""
    try:
        return getattr(checks, call)(*args)
    except ConfigError as exc:
        return exc


def _same(u, v) -> bool:
    if isinstance(u, ConfigError) or isinstance(v, ConfigError):
        return type(u) is type(v) and str(u) == str(v)
    # the same tensors, or copies of one (the full checks copy a tensor that is not contiguous)
    return all(a is b or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
               for a, b in zip(u, v, strict=True))


def _checks(quick: str, read_values: bool = False) -> LowLatencyChecks:
    """Checks whose quick acceptance of tensors is ``quick``: "compiled" (ep.kernels.host's
    ``ll_*_accepts``, what a built host module gives) or "python" (without one)."""
    checks = LowLatencyChecks(LAYOUT, -1, read_values=read_values)
    if quick == "python":
        checks._compiled = False
    elif checks._host_steps() is None:
        pytest.skip("ep.kernels.host did not build here")
    return checks


QUICK = pytest.mark.parametrize("quick", ["compiled", "python"])


def _quick_agrees_with_full(call: str, args: tuple, quick: str) -> None:
    """The checks give what the full checks alone give; what the quick acceptance takes comes back
    as the very tensors passed, from both."""
    checks, full_only = _checks(quick), _checks(quick)
    setattr(full_only, f"accepts_{call}", lambda *a: False)
    if call == "combine":  # (which also makes the output, with the compiled acceptance)
        full_only.combine_output = lambda *a: None
    quick, full = _answer(checks, call, *args), _answer(full_only, call, *args)
    if call == "combine" and not isinstance(quick, ConfigError):  # the output: ``out``, or a new [N, H]
        out, handle = args[8], args[3]
        for combined in (quick[3], full[3]):
            assert combined is out if out is not None else (
                combined.dtype == torch.bfloat16 and combined.shape == (handle.num_tokens, HIDDEN))
        quick, full = quick[:3], full[:3]
    assert _same(quick, full)
    if getattr(checks, f"accepts_{call}")(*args):  # taken as they are: the full checks copy nothing either
        assert all(got is given for got, given in zip(quick, args))
        assert all(got is given for got, given in zip(full, args))


@QUICK
@settings(max_examples=300, deadline=None)
@given(args=dispatch_args())
def test_a_dispatch_the_quick_acceptance_takes_is_one_the_full_checks_pass_unchanged(args, quick):
    _quick_agrees_with_full("dispatch", args, quick)


@QUICK
@settings(max_examples=300, deadline=None)
@given(args=combine_args())
def test_a_combine_the_quick_acceptance_takes_is_one_the_full_checks_pass_unchanged(args, quick):
    _quick_agrees_with_full("combine", args, quick)


@QUICK
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_the_device_paths_common_calls_are_taken_by_the_quick_acceptance(idx_dtype, quick):
    """What DeepEP's callers pass (hook or not, FP8 or not, async or not) skips the full checks;
    the host path, which reads expert ids, never does."""
    checks = _checks(quick)
    x, idx = torch.zeros(T, HIDDEN, dtype=torch.bfloat16), torch.zeros(T, K, dtype=idx_dtype)
    cumulative, waits = torch.zeros(E // R, dtype=torch.int32), torch.zeros(R, dtype=torch.int64)
    for fp8, hook, finish in ((True, False, False), (True, True, False), (False, False, True)):
        assert checks.accepts_dispatch(x, idx, T, E, fp8, fp8, False, finish, hook, None, None)
        assert checks.accepts_dispatch(x, idx, T, E, fp8, fp8, False, finish, hook, cumulative, None)  # DeepEP's tests'
        assert checks.accepts_dispatch(x, idx, T, E, fp8, fp8, False, finish, hook, cumulative, waits)
    handle = types.SimpleNamespace(num_tokens=T, num_topk=K, num_max_dispatch_tokens_per_rank=T)
    y, w = torch.zeros(E // R, R * T, HIDDEN, dtype=torch.bfloat16), torch.zeros(T, K)
    out = torch.zeros(T, HIDDEN, dtype=torch.bfloat16)
    for zero_copy, hook, given_out, stats in ((False, False, None, None), (True, True, out, waits)):
        assert checks.accepts_combine(y, idx, w, handle, False, zero_copy, False, hook, given_out, stats)
        combined = checks.combine_output(y, idx, w, handle, False, zero_copy, False, hook, given_out, stats)
        assert combined is given_out if given_out is not None else combined.shape == (T, HIDDEN)
    for bad in (torch.zeros(E // R + 1, dtype=torch.int32), torch.zeros(E // R, dtype=torch.int64)):  # length, dtype
        assert not checks.accepts_dispatch(x, idx, T, E, True, False, False, False, False, bad, None)
        with pytest.raises(ConfigError, match="cumulative_local_expert_recv_stats"):
            checks.dispatch(x, idx, T, E, True, False, False, False, False, bad, None)
    for bad in (torch.zeros(R + 1, dtype=torch.int64), torch.zeros(R, dtype=torch.int32)):
        assert not checks.accepts_dispatch(x, idx, T, E, True, False, False, False, False, None, bad)
        assert not checks.accepts_combine(y, idx, w, handle, False, False, False, False, None, bad)
    host = _checks(quick, read_values=True)
    assert not host.accepts_dispatch(x, idx, T, E, True, False, False, False, False, None, None)


@QUICK
def test_a_tensor_the_full_checks_would_copy_is_not_taken_as_it_is(quick):
    """A strided tensor in the common call (each argument in turn) goes to the full checks, which
    copy it (the kernels read rows at their natural strides), or refuse a statistics tensor (the
    kernels add into it)."""
    checks = _checks(quick)

    def strided(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)[..., ::2]

    dispatch = [torch.zeros(T, HIDDEN, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int64),
                torch.zeros(E // R, dtype=torch.int32), torch.zeros(R, dtype=torch.int64)]
    assert checks.accepts_dispatch(*dispatch[:2], T, E, True, False, False, False, False, *dispatch[2:])
    for i in range(4):
        args = list(dispatch)
        args[i] = strided(args[i])
        assert not checks.accepts_dispatch(*args[:2], T, E, True, False, False, False, False, *args[2:]), i
    with pytest.raises(ConfigError, match="cumulative_local_expert_recv_stats must be contiguous"):
        checks.dispatch(*dispatch[:2], T, E, True, False, False, False, False, strided(dispatch[2]), None)
    handle = types.SimpleNamespace(num_tokens=T, num_topk=K, num_max_dispatch_tokens_per_rank=T)
    combine = [torch.zeros(E // R, R * T, HIDDEN, dtype=torch.bfloat16), dispatch[1], torch.zeros(T, K),
               torch.zeros(T, HIDDEN, dtype=torch.bfloat16), torch.zeros(R, dtype=torch.int64)]
    assert checks.accepts_combine(*combine[:3], handle, False, False, False, False, *combine[3:])
    for i in range(5):
        args = list(combine)
        args[i] = strided(args[i])
        assert not checks.accepts_combine(*args[:3], handle, False, False, False, False, *args[3:]), i
