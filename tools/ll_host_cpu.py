"""The Python of low-latency device-path calls, timed on any machine (no GPU): a one-rank runtime
whose ``DevicePath`` launches through ``PreparedLaunch`` and ``host.cpp``'s ``launch_prepared``
into a C stand-in for ``cuLaunchKernel`` (``sched_yield``), so every host step of an eager call
runs but the driver's. For changes to the host path between GPU sessions: the same code timed on
the GPU hosts measured (``ll_host_profile.py``) took 2-3x as long, plus the driver's launch.

    PYTHONPATH=src python tools/ll_host_cpu.py [--calls 4000] [--profile "dispatch hook"]

Prints the median (min) us of each call of an iteration (a dispatch's send with a hook, the hook,
a combine's send with a hook, its hook, a dispatch and a combine without hooks; FP8 dispatch,
128 tokens x 7168, top-8 of 256), then, with ``--profile``, that call's top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats
import statistics
import time
from types import SimpleNamespace

import torch

from warmlink.ep.kernels import host
from warmlink.ep.kernels.launch import CHECK_INT32, CHECK_NONE, PreparedLaunch
from warmlink.ep.low_latency import _device
from warmlink.ep.low_latency._checks import LowLatencyChecks
from warmlink.ep.low_latency._runtime import LowLatencyRuntime
from warmlink.rendezvous import Store

CALLS = ("dispatch send (hook)", "dispatch hook", "combine send (hook)", "combine hook", "dispatch", "combine")
TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 256, 8


def _prepared(compiled, num_args: int, ints: set[int]) -> PreparedLaunch:
    """A prepared launch reading every argument (a tensor's address, or an int32 at ``ints``)."""
    offsets, params, at = [], [], 0
    for i in range(num_args):
        size = 4 if i in ints else 8
        at = -(-at // size) * size
        offsets.append(at)
        at += size
        params.append((0, size, CHECK_INT32 if size == 4 else CHECK_NONE, i))
    driver = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
    return PreparedLaunch(driver, 0xF00D, 128, 0, offsets, params, compiled.launch_prepared, "stand-in")


class _Prepared(dict):
    """Every kind of call has its prepared launch: the dispatch's or the combine's stand-in."""

    def __init__(self, compiled) -> None:
        super().__init__()
        self._by_kernel = {"dispatch": _prepared(compiled, 9, {5, 6, 7, 8}),
                           "combine": _prepared(compiled, 13, {9, 10, 11, 12})}

    def get(self, kind, default=None):
        return self._by_kernel[kind[0]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--profile", default=None, choices=CALLS, help="the call whose cProfile is printed")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    compiled = host.module()
    if compiled is None:
        raise SystemExit("ep.kernels.host did not build here (a warning said why): nothing to time")
    _device.current_stream = lambda device: 0  # (no CUDA: stream 0 for the stand-in)
    store = Store(is_server=True, prefix="ll-host-cpu", timeout_s=30)
    rt = LowLatencyRuntime(store, 0, 1, max_tokens=TOKENS, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK,
                           device=-1, backend="shm", timeout_s=30)
    try:
        # the device path in place of the host path, its launches into the stand-in
        path = _device.DevicePath(rt.layout, 0, {0: rt._region.ptr}, torch.device("cpu"), 30, rt._outputs,
                                  SimpleNamespace(dispatch=None, combine=None, mask_kernel=None))
        path._prepared = _Prepared(compiled)
        rt._path, rt._on_device = path, True
        rt._checks = LowLatencyChecks(rt.layout, -1, read_values=False)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
        idx = torch.rand(TOKENS, EXPERTS, generator=gen).topk(TOPK, 1).indices
        w = torch.rand(TOKENS, TOPK, generator=gen)
        y = torch.randn(rt.layout.local_experts, TOKENS, HIDDEN).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in CALLS}
        profiler = cProfile.Profile()

        def timed(name: str, fn, *call_args):
            profiling = name == args.profile
            if profiling:
                profiler.enable()
            start = time.perf_counter()
            result = fn(*call_args)
            times[name].append(time.perf_counter() - start)
            if profiling:
                profiler.disable()
            return result

        def dispatch(hook: bool):
            return rt.dispatch(x, idx, TOKENS, EXPERTS, None, None, True, False, False, False, hook)

        def combine(handle, hook: bool):
            return rt.combine(y, idx, w, handle, False, False, False, hook, None, None)

        for _ in range(args.calls):
            sent = timed("dispatch send (hook)", dispatch, True)
            timed("dispatch hook", sent[4])
            timed("combine hook", timed("combine send (hook)", combine, sent[2], True)[2])
            timed("combine", combine, timed("dispatch", dispatch, False)[2], False)
        print(f"one rank, {TOKENS} tokens x {HIDDEN}, top-{TOPK} of {EXPERTS}, FP8 dispatch; the device path's host "
              f"steps with a stand-in driver, median (min) of {args.calls}, us")
        for name, t in times.items():
            print(f"  {name:22s} {statistics.median(t) * 1e6:6.2f} ({min(t) * 1e6:5.2f})")
        if args.profile:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
            print(out.getvalue())
    finally:
        rt.close()
        store.close()


if __name__ == "__main__":
    main()
