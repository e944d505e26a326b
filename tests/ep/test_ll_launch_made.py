"""The common eager low-latency calls launched in one compiled call (``DevicePath.dispatch_made`` and
``combine_made``, ep.low_latency._device, through ``host.cpp``'s ``ll_dispatch_launch`` and
``ll_combine_launch``), their launches caught by a ctypes function standing in for
``cuLaunchKernel`` on CPU tensors: whatever the tensors, a call launches exactly when
``LowLatencyChecks`` takes them as they are, with the parameters ``dispatch`` and ``combine``
launch for the same call (the combine's output, given or made, among them); otherwise it launches
nothing and the runtime's full checks take over. A driver error is raised."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ep._launch_driver import FUNCTION, STREAM, Driver
from tests.ep._ll_call_args import HIDDEN, LAYOUT, combine_args, dispatch_args
from warmlink.ep.kernels.launch import CHECK_NONE, PackedLaunch
from warmlink.ep.low_latency import _device
from warmlink.ep.low_latency._checks import LowLatencyChecks
from warmlink.ep.low_latency._device import BOTH, RECV, SEND, DevicePath
from warmlink.ep.low_latency._outputs import Outputs

ARGS = {"dispatch": 8, "combine": 12}  # the call's own arguments, which a prepared launch reads


def _plan(driver: Driver, kernel: str, compiled, receive: bool = False) -> PackedLaunch:
    """A launch of 8-byte parameters, each read from the call's argument of its index."""
    n = ARGS[kernel]
    return PackedLaunch(driver.address, FUNCTION + receive, 128, 0, list(range(0, 8 * n, 8)),
                        [(0, 8, CHECK_NONE, i) for i in range(n)], compiled, kernel)


def _path(compiled, monkeypatch, error: int = 0) -> tuple[DevicePath, Driver]:
    """A device path on CPU whose every kind of call (parity 0) has a prepared launch into a
    recording stand-in, and each send's receive one too."""
    monkeypatch.setattr(_device, "current_stream", lambda device: STREAM)
    kernels = types.SimpleNamespace(dispatch=None, combine=None, mask_kernel=None)
    path = DevicePath(LAYOUT, 0, {0: 1 << 20, 1: 2 << 20}, torch.device("cpu"), 1.0, Outputs(LAYOUT, -1), kernels)
    driver = Driver([8] * max(ARGS.values()), error=error)
    path._prepared, path._receives = {}, {}
    for phase in (SEND, BOTH):
        for waits in (False, True):
            for dtype in (torch.int64, torch.int32):
                for cum in (False, True):
                    for fp8, scale, ue8m0 in ((True, False, False), (True, True, False), (True, True, True),
                                              (False, False, False)):
                        kind = ("dispatch", phase, fp8, scale, ue8m0, cum, waits, 0, dtype)
                        path._prepared[kind] = _plan(driver, "dispatch", compiled)
                        path._receives[kind] = _plan(driver, "dispatch", compiled, receive=True)
                kind = ("combine", phase, waits, 0, dtype)
                path._prepared[kind] = _plan(driver, "combine", compiled)
                path._receives[kind] = _plan(driver, "combine", compiled, receive=True)
    return path, driver


def _handle(handle):
    """The generated handle with the other tensors a combine's launch passes."""
    got = types.SimpleNamespace(**vars(handle))
    got.layout_range = torch.zeros(LAYOUT.num_experts, dtype=torch.int64)
    got.comb_slot = torch.zeros(LAYOUT.slots, dtype=torch.int64)
    return got


@settings(max_examples=200, deadline=None)
@given(args=combine_args(), hook=st.booleans())
def test_a_combine_launches_in_one_call_exactly_when_its_tensors_are_taken_as_the_combine_would_launch(
        compiled, args, hook):
    x, idx, w, handle, _, _, _, _, out, waits = args
    handle = _handle(handle)
    with pytest.MonkeyPatch.context() as mp:
        path, driver = _path(compiled, mp)
        phase = SEND if hook else BOTH
        taken = LowLatencyChecks(LAYOUT, -1, read_values=False).accepts_combine(x, idx, w, handle, False, False, False, hook, out, waits)
        made = path.combine_made(phase, 0, x, handle, idx, w, out, 7, waits)
        assert (made is not None) == taken
        assert len(driver.launches) == int(taken)
        if not taken:
            return
        combined, packed = made
        assert combined is out if out is not None else (combined.dtype == torch.bfloat16
                                                        and combined.shape == (handle.num_tokens, HIDDEN))
        assert packed is (path._receives[("combine", SEND, waits is not None, 0, idx.dtype)] if hook else None)
        path.combine(phase, 0, x, handle, idx, w, combined, 7, waits)  # what the combine launches for it
        (*first, values, _), (*second, again, _) = driver.launches
        assert first == second and values == again
        assert int.from_bytes(values[6], "little") == combined.data_ptr()
        if hook:  # the receive the send packed: its grid and the same values
            assert packed.launch_pending(STREAM)
            assert driver.launches[-1][1] == (path._grids["combine", RECV][handle.num_tokens], 1, 1)
            assert driver.launches[-1][5] == values


@settings(max_examples=200, deadline=None)
@given(args=dispatch_args(), hook=st.booleans())
def test_a_dispatch_launches_in_one_call_exactly_when_its_tensors_are_taken_as_the_dispatch_would_launch(
        compiled, args, hook):
    x, idx, tokens, experts, fp8, scale, ue8m0, finish, _, cumulative, waits = args
    checks = LowLatencyChecks(LAYOUT, -1, read_values=False)
    if not checks.plain_dispatch_flags(tokens, experts, fp8, scale, ue8m0, finish, hook):
        return  # (the runtime calls it only for the common flags: the full checks name the others)
    with pytest.MonkeyPatch.context() as mp:
        path, driver = _path(compiled, mp)
        phase = SEND if hook else BOTH
        taken = checks.accepts_dispatch(x, idx, tokens, experts, fp8, scale, ue8m0, finish, hook, cumulative, waits)
        made = path.dispatch_made(phase, 0, x, idx, tokens, fp8, scale, ue8m0, 9, cumulative, waits)
        assert (made is not None) == taken
        assert len(driver.launches) == int(taken)
        if not taken:
            return
        kind = ("dispatch", SEND, fp8, scale, ue8m0, cumulative is not None, waits is not None, 0, idx.dtype)
        assert made == ((path._receives[kind] if hook else None),)
        path.dispatch(phase, 0, x, idx, tokens, fp8, scale, ue8m0, 9, cumulative, waits)
        (*first, values, _), (*second, again, _) = driver.launches
        assert first == second and values == again


def test_a_driver_error_is_raised_and_a_kind_without_a_prepared_launch_is_declined(compiled, monkeypatch):
    path, driver = _path(compiled, monkeypatch, error=700)
    x, idx = torch.zeros(4, HIDDEN, dtype=torch.bfloat16), torch.zeros(4, LAYOUT.num_topk, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="ep low-latency dispatch: cuLaunchKernel failed with CUDA error 700"):
        path.dispatch_made(BOTH, 0, x, idx, 8, True, False, False, 1, None, None)
    y = torch.zeros(LAYOUT.local_experts, LAYOUT.num_ranks * 8, HIDDEN, dtype=torch.bfloat16)
    handle = types.SimpleNamespace(num_tokens=4, num_topk=LAYOUT.num_topk, num_max_dispatch_tokens_per_rank=8,
                                   dispatched=torch.ones(4, LAYOUT.num_topk, dtype=torch.bool),
                                   layout_range=torch.zeros(8, dtype=torch.int64), comb_slot=torch.zeros(8))
    w = torch.zeros(4, LAYOUT.num_topk)
    with pytest.raises(RuntimeError, match="ep low-latency combine: cuLaunchKernel failed with CUDA error 700"):
        path.combine_made(BOTH, 0, y, handle, idx, w, None, 1, None)
    driver.error = 0
    path._prepared.clear()  # the kind's first call: no prepared launch yet, Triton's launcher takes it
    assert path.dispatch_made(BOTH, 0, x, idx, 8, True, False, False, 1, None, None) is None
    assert path.combine_made(BOTH, 0, y, handle, idx, w, None, 1, None) is None
    assert len(driver.launches) == 2  # (the two that failed)
