"""A one-rank low-latency runtime on CPU whose device path launches into ctypes stand-ins for
``cuLaunchKernel`` (``_launch_driver.Driver``): every host step of a device-path call runs, the
kernels do not, and each launch is recorded (test_ll_hooks.py, test_ll_rounds_stateful.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.ep._launch_driver import Driver
from warmlink.ep.kernels.launch import CHECK_INT32, CHECK_NONE, PackedLaunch
from warmlink.ep.low_latency import _device
from warmlink.ep.low_latency._checks import LowLatencyChecks
from warmlink.ep.low_latency._device import BOTH, RECV, SEND
from warmlink.ep.low_latency._runtime import LowLatencyRuntime

T, HIDDEN, E, K = 8, 256, 8, 4
# the kernels' runtime arguments (DevicePath.dispatch / combine, the call's then the parity's): how
# many, and which are int32 (the timeout, 30 s in ns, is not)
ARGS = {"dispatch": (30, {4, 5, 6, 7, 22, 23, 24, 25, 26, 28, 29}), "combine": (23, {8, 9, 10, 11, 17, 18, 19, 20, 22})}
CALL_ARGS = {"dispatch": 8, "combine": 12}  # the first ones, which a call passes (the parity's are fixed)
FUNCTIONS = {(name, phase): 0x100 * (i + 1) + phase for i, name in enumerate(ARGS) for phase in (SEND, RECV, BOTH)}


class Kernel:
    """A kernel's launcher for the launches no ``PackedLaunch`` makes: ``kernel[grid](*args, **consts)``."""

    def __init__(self, name: str) -> None:
        self.name, self.launches = name, []

    def __getitem__(self, grid):
        return lambda *args, **consts: self.launches.append((grid, args, consts))


def sizes(name: str) -> list[int]:
    """Each argument's bytes: a tensor's address, or an int32."""
    num_args, ints = ARGS[name]
    return [4 if i in ints else 8 for i in range(num_args)]


def plan(driver: Driver, compiled, name: str, phase: int, offset: int = 0) -> PackedLaunch:
    """The call's arguments read from it, the parity's fixed (zero here); its function
    ``FUNCTIONS[name, phase] + offset``."""
    offsets, params, at = [], [], 0
    for i, size in enumerate(sizes(name)):
        at = -(-at // size) * size
        offsets.append(at)
        at += size
        params.append((0, size, CHECK_INT32 if size == 4 else CHECK_NONE, i if i < CALL_ARGS[name] else -1))
    return PackedLaunch(driver.address, FUNCTIONS[name, phase] + offset, 128, 0, offsets, params, compiled, name)


def device_runtime(store) -> tuple[LowLatencyRuntime, SimpleNamespace]:
    """``(runtime, kernels)``: a one-rank runtime (``T`` tokens of ``HIDDEN``, ``E`` experts, top-``K``)
    on the device path, whose launches without a prepared one go to ``kernels``' recorders (the
    caller adds the prepared launches to ``runtime._path._prepared``; ``current_stream`` must be
    patched: there is no CUDA)."""
    rt = LowLatencyRuntime(store, 0, 1, max_tokens=T, hidden=HIDDEN, num_experts=E, num_topk=K, device=-1,
                           backend="shm", timeout_s=30)
    kernels = SimpleNamespace(dispatch=Kernel("dispatch"), combine=Kernel("combine"), mask_kernel=None)
    rt._path = _device.DevicePath(rt.layout, 0, {0: rt._region.ptr}, torch.device("cpu"), 30, rt._outputs, kernels)
    rt._on_device = True
    rt._checks = LowLatencyChecks(rt.layout, -1, read_values=False)
    return rt, kernels
