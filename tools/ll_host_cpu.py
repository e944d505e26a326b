"""The Python of low-latency device-path calls, timed on any machine (no GPU): a one-rank runtime
whose ``DevicePath`` launches its ``PackedLaunch`` plans through ``host.cpp`` (``launch_prepared``;
the common calls' ``ll_dispatch_launch`` and ``ll_combine_launch``) into a C stand-in for
``cuLaunchKernel`` (``sched_yield``), so every host step of an eager call runs but the driver's.
For changes to the host path between GPU sessions: the same code timed on the GPU hosts measured
(``ll_host_profile.py``) took 2-3x as long, plus the driver's launch.

    PYTHONPATH=src python tools/ll_host_cpu.py [--calls 4000] [--facade deep_ep] [--profile "dispatch hook"]

Prints the median (min) us of each call of an iteration (a dispatch's send with a hook, the hook,
a combine's send with a hook, its hook, a dispatch and a combine without hooks; FP8 dispatch,
128 tokens x 7168, top-8 of 256), then, with ``--profile``, that call's top functions by own time.
``--facade`` says what is called: the runtime itself, ``ep.Buffer`` or ``deep_ep.Buffer`` (what
DeepEP's callers and ``bench ep --low-latency`` call), each over the same stand-in.
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

from warmlink import ep
from warmlink.ep import deep_ep
from warmlink.ep.kernels import host
from warmlink.ep.kernels.launch import CHECK_INT32, CHECK_NONE, PackedLaunch
from warmlink.ep.low_latency import _device
from warmlink.ep.low_latency._checks import LowLatencyChecks
from warmlink.ep.low_latency._runtime import LowLatencyRuntime
from warmlink.rendezvous import Store

FACADES = ("runtime", "ep", "deep_ep")
CALLS = ("dispatch send (hook)", "dispatch hook", "combine send (hook)", "combine hook", "dispatch", "combine")
TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 256, 8


def _prepared(compiled, num_args: int, ints: set[int], reads: int) -> PackedLaunch:
    """A prepared launch of ``num_args`` parameters (a tensor's address, or an int32 at ``ints``)
    reading the first ``reads`` from each call (a call passes those alone: the real ones read the
    call's own arguments and keep the parity's)."""
    offsets, params, at = [], [], 0
    for i in range(num_args):
        size = 4 if i in ints else 8
        at = -(-at // size) * size
        offsets.append(at)
        at += size
        params.append((0, size, CHECK_INT32 if size == 4 else CHECK_NONE, i if i < reads else -1))
    driver = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
    return PackedLaunch(driver, 0xF00D, 128, 0, offsets, params, compiled, "stand-in")


class _Prepared(dict):
    """Every kind of call has its prepared launch: the dispatch's or the combine's stand-in, one for
    the receive phase and one for the others; ``receives`` keys the receives' by their sends' kinds."""

    def __init__(self, compiled, receives: bool = False) -> None:
        super().__init__()
        self._receives = receives
        self._by_kernel = {(name, recv): _prepared(compiled, num_args, ints, reads)
                           for name, num_args, ints, reads in (
                               ("dispatch", 30, {4, 5, 6, 7, 22, 23, 24, 25, 26, 28, 29}, 8),
                               ("combine", 23, {8, 9, 10, 11, 17, 18, 19, 20, 22}, 12))
                           for recv in (False, True)}

    def get(self, kind, default=None):
        return self._by_kernel[kind[0], self._receives or kind[1] == _device.RECV]

    def receives(self) -> "_Prepared":
        view = _Prepared.__new__(_Prepared)
        view._receives, view._by_kernel = True, self._by_kernel
        return view


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--profile", default=None, choices=CALLS, help="the call whose cProfile is printed")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--facade", default="runtime", choices=FACADES, help="what is called (default: the runtime)")
    args = p.parse_args()
    compiled = host.module()
    if compiled is None:
        raise SystemExit("ep.kernels.host did not build here (a warning said why): nothing to time")
    _device.current_stream = lambda device: 0  # (no CUDA: stream 0 for the stand-in)
    store = Store(is_server=True, prefix="ll-host-cpu", timeout_s=30)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    idx = torch.rand(TOKENS, EXPERTS, generator=gen).topk(TOPK, 1).indices
    w = torch.rand(TOKENS, TOPK, generator=gen)
    rt, dispatch, combine, close = _facade(args.facade, store, x, idx, w)
    try:
        # the device path in place of the host path, its launches into the stand-in
        path = _device.DevicePath(rt.layout, 0, {0: rt._region.ptr}, torch.device("cpu"), 30, rt._outputs,
                                  SimpleNamespace(dispatch=None, combine=None, mask_kernel=None))
        path._prepared = _Prepared(compiled)
        path._receives = path._prepared.receives()
        rt._path, rt._on_device = path, True
        rt._checks = LowLatencyChecks(rt.layout, -1, read_values=False)
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

        for _ in range(args.calls):
            sent = timed("dispatch send (hook)", dispatch, True)
            timed("dispatch hook", sent[4])
            timed("combine hook", timed("combine send (hook)", combine, y, sent[2], True)[-1])
            timed("combine", combine, y, timed("dispatch", dispatch, False)[2], False)
        print(f"one rank, {TOKENS} tokens x {HIDDEN}, top-{TOPK} of {EXPERTS}, FP8 dispatch, through {args.facade}; "
              f"the device path's host steps with a stand-in driver, median (min) of {args.calls}, us")
        for name, t in times.items():
            print(f"  {name:22s} {statistics.median(t) * 1e6:6.2f} ({min(t) * 1e6:5.2f})")
        if args.profile:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
            print(out.getvalue())
    finally:
        close()
        store.close()


def _facade(name: str, store: Store, x, idx, w):
    """``(runtime, dispatch(hook), combine(y, handle, hook), close)``: the calls through facade
    ``name`` over a one-rank runtime on the host path, built here (its path is replaced after)."""
    sizes = {"hidden": HIDDEN, "num_topk": TOPK, "device": -1, "backend": "shm", "timeout_s": 30}
    if name == "runtime":
        rt = LowLatencyRuntime(store, 0, 1, max_tokens=TOKENS, num_experts=EXPERTS, **sizes)
        return (rt, lambda hook: rt.dispatch(x, idx, TOKENS, EXPERTS, None, None, True, False, False, False, hook),
                lambda y, handle, hook: rt.combine(y, idx, w, handle, False, False, False, hook, None, None), rt.close)
    if name == "ep":
        buf = ep.Buffer(store, 0, 1, max_tokens_per_rank=TOKENS, low_latency_mode=True, num_experts=EXPERTS, **sizes)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        size = deep_ep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, 1, EXPERTS, TOPK)
        buf = deep_ep.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, explicitly_destroy=True)
        buf.low_latency_dispatch(x, idx, TOKENS, EXPERTS)  # (builds its ep.Buffer: Note [Low-latency built on first call])

    def close() -> None:
        buf.destroy() if name == "deep_ep" else buf.close()

    rt = (buf._ll if name == "deep_ep" else buf)._low_latency
    return (rt, lambda hook: buf.low_latency_dispatch(x, idx, TOKENS, EXPERTS, return_recv_hook=hook),
            lambda y, handle, hook: buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook), close)


if __name__ == "__main__":
    main()
