"""``PackedLaunch`` (ep.kernels.launch) through ``host.cpp``'s ``launch_prepared``, its launches
caught by a ctypes function standing in for ``cuLaunchKernel``: every parameter reaches the driver
at its offset, the fixed ones as packed and the varying ones read from the call's arguments (a
tensor's address, an int), with the grid, block, shared bytes and stream; a value that breaks what
the kernel was compiled for (an address it assumed 16-byte aligned, an int it took as 32 bits)
launches nothing; a driver error is raised by its code. A launch packed by another's call (``then``:
a low-latency send packs its receive hook's) is made once by ``launch_pending``, with the call's
values and its own fixed parameters, grid and function, and only where that call launched. Built
here by the machine's C++ compiler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ep._launch_driver import FUNCTION, STREAM, Driver
from warmlink.ep.kernels.launch import CHECK_ALIGNED, CHECK_INT32, CHECK_NONE, PLAN_MAX_PARAMS, PackedLaunch


def _offsets(sizes: list[int]) -> list[int]:
    """Each parameter at its natural alignment, as a kernel's parameter buffer lays them out."""
    offsets, at = [], 0
    for size in sizes:
        at = (at + size - 1) // size * size
        offsets.append(at)
        at += size
    return offsets


def _bytes(value: int, size: int) -> bytes:
    return int(value).to_bytes(size, "little", signed=value < 0)


# a parameter: 8-byte (an address or an int64) or 4-byte (an int32), fixed or read from an argument
_param = st.tuples(st.sampled_from([4, 8]), st.booleans(), st.integers(-2**31, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(params=st.lists(_param, min_size=1, max_size=20), grid=st.integers(1, 4096), threads=st.sampled_from([128, 256]),
       shared=st.integers(0, 100_000), tensor_at=st.integers(0, 19))
def test_each_parameter_reaches_the_driver_fixed_as_packed_or_read_from_the_calls_arguments(
        compiled, params, grid, threads, shared, tensor_at):
    sizes = [size for size, _, _ in params]
    offsets = _offsets(sizes)
    tensor = torch.zeros(16, dtype=torch.int64)  # a varying 8-byte parameter may be given a tensor: its address
    args, packed = [], []
    for i, (size, varying, value) in enumerate(params):
        if varying and size == 8 and i == tensor_at:
            args.append(tensor)
            value = tensor.data_ptr()
        else:
            args.append(value)
        fixed = value if not varying else value ^ 0x5A5A  # what was packed must not be what the call passes
        if size == 4 and not -2**31 <= fixed < 2**31:
            fixed = value
        packed.append((fixed, size, CHECK_INT32 if size == 4 else CHECK_NONE, i if varying else -1))
    driver = Driver(sizes)
    launch = PackedLaunch(driver.address, FUNCTION, threads, shared, offsets, packed, compiled, "k")
    assert launch(grid, STREAM, tuple(args))
    (function, grid_xyz, block, shared_bytes, stream, values, extra), = driver.launches
    assert (function, grid_xyz, block, shared_bytes, stream, extra) == (FUNCTION, (grid, 1, 1), (threads, 1, 1), shared,
                                                                        STREAM, None)
    want = [_bytes(tensor.data_ptr() if (varying and size == 8 and i == tensor_at) else value, size)
            for i, (size, varying, value) in enumerate(params)]
    assert values == want


@pytest.mark.parametrize("check,value,launched", [
    (CHECK_ALIGNED, 0x1000, True), (CHECK_ALIGNED, 0x1008, False), (CHECK_NONE, 0x1008, True),
    (CHECK_INT32, 2**31 - 1, True), (CHECK_INT32, 2**31, False), (CHECK_INT32, -2**31 - 1, False)])
def test_a_value_that_breaks_what_the_kernel_was_compiled_for_launches_nothing(compiled, check, value, launched):
    size = 4 if check == CHECK_INT32 else 8
    driver = Driver([8, size])
    launch = PackedLaunch(driver.address, FUNCTION, 128, 0, [0, 8], [(7, 8, CHECK_NONE, -1), (0, size, check, 1)],
                          compiled, "k")
    assert launch(4, STREAM, ("ignored", value)) is launched
    assert len(driver.launches) == int(launched)


def test_a_misaligned_tensor_is_declined_where_the_kernel_assumed_alignment(compiled):
    driver = Driver([8])
    launch = PackedLaunch(driver.address, FUNCTION, 128, 0, [0], [(0, 8, CHECK_ALIGNED, 0)], compiled,
                          "k")
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert launch(1, STREAM, (base,))
    assert not launch(1, STREAM, (base[1:],))  # 2 bytes past an aligned address
    assert len(driver.launches) == 1


def test_a_driver_error_is_raised_by_its_code_and_a_zero_grid_launches_nothing(compiled):
    driver = Driver([8], error=701)
    launch = PackedLaunch(driver.address, FUNCTION, 128, 0, [0], [(5, 8, CHECK_NONE, -1)], compiled,
                          "my_kernel")
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel\(my_kernel, grid 3\): CUDA error 701"):
        launch(3, STREAM, ())
    assert not launch(0, STREAM, ())
    assert len(driver.launches) == 1


def test_a_set_triton_launch_hook_makes_every_call_decline_so_that_tritons_launcher_calls_it(compiled):
    from triton import knobs

    driver = Driver([8])
    launch = PackedLaunch(driver.address, FUNCTION, 128, 0, [0], [(5, 8, CHECK_NONE, -1)], compiled,
                          "k", hooks=knobs.runtime)
    assert launch(1, STREAM, ())  # no hook set
    for which in ("launch_enter_hook", "launch_exit_hook"):
        saved = getattr(knobs.runtime, which)
        hook = type(saved)() if hasattr(saved, "calls") else None  # a HookChain of its own (Triton >= 3.5)
        if hook is None:
            setattr(knobs.runtime, which, lambda *args: None)
        else:
            hook.add(lambda *args: None)
            setattr(knobs.runtime, which, hook)
        try:
            assert not launch(1, STREAM, ()), which
            assert launch.plan() == 0, which  # (a compiled call launching the plan itself declines alike)
        finally:
            setattr(knobs.runtime, which, saved)
    assert launch(1, STREAM, ())
    assert launch.plan() != 0
    assert len(driver.launches) == 2


def test_too_many_parameters_are_refused_when_prepared(compiled):
    too_many = PLAN_MAX_PARAMS + 1  # (in bytes within the plan's buffer: the count alone is refused)
    with pytest.raises(ValueError, match="parameters"):
        PackedLaunch(0, FUNCTION, 128, 0, list(range(0, 8 * too_many, 8)), [(0, 8, CHECK_NONE, -1)] * too_many,
                     compiled, "k")


def _plan(driver: Driver, function: int, fixed: int, check: int = CHECK_NONE, compiled=None) -> PackedLaunch:
    """Three 8-byte parameters: ``fixed``, argument 0 (a tensor's address) and argument 1 (an int)."""
    return PackedLaunch(driver.address, function, 64, 16, [0, 8, 16],
                        [(fixed, 8, CHECK_NONE, -1), (0, 8, check, 0), (0, 8, CHECK_NONE, 1)], compiled, "k")


@settings(max_examples=40, deadline=None)
@given(value=st.integers(-2**62, 2**62), grid=st.integers(1, 4096), then_grid=st.integers(1, 4096),
       offset=st.sampled_from([0, 0, 1]))
def test_a_launch_packed_by_anothers_call_is_made_once_with_that_calls_values(compiled, value, grid, then_grid, offset):
    driver = Driver([8, 8, 8])
    send, receive = _plan(driver, FUNCTION, 11, compiled=compiled), _plan(driver, FUNCTION + 1, 22, compiled=compiled)
    base = torch.zeros(64, dtype=torch.int64)
    x = base[offset:]  # a misaligned one breaks neither plan: they assume nothing of it
    assert not receive.launch_pending(STREAM)  # nothing packed yet
    assert send(grid, STREAM, (x, value), receive, then_grid)
    assert receive.launch_pending(STREAM + 1)
    assert not receive.launch_pending(STREAM + 1)  # made once
    values = [_bytes(11, 8), _bytes(x.data_ptr(), 8), _bytes(value, 8)]
    assert driver.launches == [(FUNCTION, (grid, 1, 1), (64, 1, 1), 16, STREAM, values, None),
                               (FUNCTION + 1, (then_grid, 1, 1), (64, 1, 1), 16, STREAM + 1,
                                [_bytes(22, 8), *values[1:]], None)]


def test_nothing_is_packed_where_the_call_did_not_launch_or_its_values_break_the_packed_plan(compiled):
    driver = Driver([8, 8, 8])
    aligned = _plan(driver, FUNCTION, 1, CHECK_ALIGNED, compiled)
    receive = _plan(driver, FUNCTION + 1, 2, compiled=compiled)
    strict_receive = _plan(driver, FUNCTION + 2, 3, CHECK_ALIGNED, compiled)
    loose = _plan(driver, FUNCTION + 3, 4, compiled=compiled)
    base = torch.zeros(64, dtype=torch.int64)
    assert not aligned(1, STREAM, (base[1:], 5), receive, 1)  # the call declined: nothing packed
    assert not receive.launch_pending(STREAM)
    assert loose(1, STREAM, (base[1:], 5), strict_receive, 1)  # launched, but the receive assumes alignment
    assert not strict_receive.launch_pending(STREAM)
    assert loose(1, STREAM, (base, 5), receive, 0)  # no grid: nothing packed
    assert not receive.launch_pending(STREAM)
    assert [launch[0] for launch in driver.launches] == [FUNCTION + 3, FUNCTION + 3]


def test_a_driver_error_packs_nothing_and_a_pending_launchs_error_is_raised(compiled):
    driver = Driver([8, 8, 8], error=700)
    send, receive = _plan(driver, FUNCTION, 1, compiled=compiled), _plan(driver, FUNCTION + 1, 2, compiled=compiled)
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        send(1, STREAM, (torch.zeros(2), 5), receive, 1)
    assert not receive.launch_pending(STREAM)
    driver.error = 0
    assert send(1, STREAM, (torch.zeros(2), 5), receive, 1)
    driver.error = 719
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel\(k, pending\): CUDA error 719"):
        receive.launch_pending(STREAM)
