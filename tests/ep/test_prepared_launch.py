"""``PreparedLaunch`` (ep.kernels.launch) through ``host.cpp``'s ``launch_prepared``, its launches
caught by a ctypes function standing in for ``cuLaunchKernel``: every parameter reaches the driver
at its offset, the fixed ones as packed and the varying ones read from the call's arguments (a
tensor's address, an int), with the grid, block, shared bytes and stream; a value that breaks what
the kernel was compiled for (an address it assumed 16-byte aligned, an int it took as 32 bits)
launches nothing; a driver error is raised by its code. Built here by the machine's C++ compiler."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.ep.kernels.launch import CHECK_ALIGNED, CHECK_INT32, CHECK_NONE, PreparedLaunch

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
FUNCTION, STREAM = 0xF00D, 0x5EA


class Driver:
    """A ``cuLaunchKernel`` that records each launch: function, grid, block, shared bytes, stream and
    each parameter's bytes (``sizes`` of them); it returns ``error``."""

    def __init__(self, sizes: list[int], error: int = 0) -> None:
        self.launches: list[tuple] = []
        self.error = error

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            values = [ctypes.string_at(params[i], size) for i, size in enumerate(sizes)]
            self.launches.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
            return self.error

        self._fn = _LAUNCH(launch)
        self.address = ctypes.cast(self._fn, ctypes.c_void_p).value


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
    launch = PreparedLaunch(driver.address, FUNCTION, threads, shared, offsets, packed, compiled.launch_prepared, "k")
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
    launch = PreparedLaunch(driver.address, FUNCTION, 128, 0, [0, 8], [(7, 8, CHECK_NONE, -1), (0, size, check, 1)],
                            compiled.launch_prepared, "k")
    assert launch(4, STREAM, ("ignored", value)) is launched
    assert len(driver.launches) == int(launched)


def test_a_misaligned_tensor_is_declined_where_the_kernel_assumed_alignment(compiled):
    driver = Driver([8])
    launch = PreparedLaunch(driver.address, FUNCTION, 128, 0, [0], [(0, 8, CHECK_ALIGNED, 0)], compiled.launch_prepared,
                            "k")
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert launch(1, STREAM, (base,))
    assert not launch(1, STREAM, (base[1:],))  # 2 bytes past an aligned address
    assert len(driver.launches) == 1


def test_a_driver_error_is_raised_by_its_code_and_a_zero_grid_launches_nothing(compiled):
    driver = Driver([8], error=701)
    launch = PreparedLaunch(driver.address, FUNCTION, 128, 0, [0], [(5, 8, CHECK_NONE, -1)], compiled.launch_prepared,
                            "my_kernel")
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel\(my_kernel, grid 3\): CUDA error 701"):
        launch(3, STREAM, ())
    assert not launch(0, STREAM, ())
    assert len(driver.launches) == 1


def test_a_set_triton_launch_hook_makes_every_call_decline_so_that_tritons_launcher_calls_it(compiled):
    from triton import knobs

    driver = Driver([8])
    launch = PreparedLaunch(driver.address, FUNCTION, 128, 0, [0], [(5, 8, CHECK_NONE, -1)], compiled.launch_prepared,
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
        finally:
            setattr(knobs.runtime, which, saved)
    assert launch(1, STREAM, ())
    assert len(driver.launches) == 2


def test_too_many_parameters_are_refused_when_prepared(compiled):
    with pytest.raises(ValueError, match="parameters"):
        PreparedLaunch(0, FUNCTION, 128, 0, list(range(0, 8 * 33, 8)), [(0, 8, CHECK_NONE, -1)] * 33,
                       compiled.launch_prepared, "k")
