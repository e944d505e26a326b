"""Host time of the CUDA calls on ep's send path, by binding (device machine, one GPU).

The ep send path makes 5-10 raw CUDA calls per operation (event records and queries, graph
launches, small copies). This times one call of each through ``cuda.bindings.runtime`` (what
``warmlink._cuda`` uses), ``cuda.bindings.driver``, and ``ctypes`` on the driver library, so that
a choice between them rests on numbers::

    python tools/cuda_call_cost.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch
from cuda.bindings import driver, runtime


def per_call_us(fn, calls: int) -> float:
    """Best of three: mean host time of ``calls`` calls (the GPU is kept idle between loops)."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000)
    n = p.parse_args().calls
    torch.cuda.set_device(0)
    torch.cuda.init()
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    event = int(runtime.cudaEventCreateWithFlags(runtime.cudaEventDisableTiming)[1])
    src, dst = torch.zeros(64, dtype=torch.int64, device=0), torch.zeros(64, dtype=torch.int64, device=0)
    # a one-node graph (a 512-byte copy), as ep replays its sends
    runtime.cudaStreamBeginCapture(s, runtime.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    runtime.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), 512, runtime.cudaMemcpyKind.cudaMemcpyDefault, s)
    graph = runtime.cudaStreamEndCapture(s)[1]
    exe = runtime.cudaGraphInstantiate(graph, 0)[1]

    cu = ctypes.CDLL("libcuda.so.1")
    for name in ("cuEventRecord", "cuEventQuery", "cuGraphLaunch", "cuStreamWaitEvent", "cuMemcpyAsync"):
        getattr(cu, name).restype = ctypes.c_int
    cu.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    cu.cuEventQuery.argtypes = [ctypes.c_void_p]
    cu.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    cu.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    cu.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    exe_int = int(exe)
    d, sp, default = dst.data_ptr(), src.data_ptr(), runtime.cudaMemcpyKind.cudaMemcpyDefault
    drv_event, drv_stream, drv_exe = driver.CUevent(event), driver.CUstream(s), driver.CUgraphExec(exe_int)
    rt_event, rt_stream = runtime.cudaEvent_t(event), runtime.cudaStream_t(s)
    rows = {
        "event record": {
            "cuda.bindings.runtime, int handles": lambda: runtime.cudaEventRecord(event, s),
            "cuda.bindings.runtime, typed handles": lambda: runtime.cudaEventRecord(rt_event, rt_stream),
            "cuda.bindings.driver, typed handles": lambda: driver.cuEventRecord(drv_event, drv_stream),
            "ctypes, libcuda": lambda: cu.cuEventRecord(event, s),
        },
        "event query": {
            "cuda.bindings.runtime, int handles": lambda: runtime.cudaEventQuery(event),
            "cuda.bindings.driver, typed handles": lambda: driver.cuEventQuery(drv_event),
            "ctypes, libcuda": lambda: cu.cuEventQuery(event),
        },
        "stream wait event": {
            "cuda.bindings.runtime, int handles": lambda: runtime.cudaStreamWaitEvent(s, event, 0),
            "ctypes, libcuda": lambda: cu.cuStreamWaitEvent(s, event, 0),
        },
        "graph launch (one 512-byte copy)": {
            "cuda.bindings.runtime, graph object": lambda: runtime.cudaGraphLaunch(exe, s),
            "cuda.bindings.driver, typed handles": lambda: driver.cuGraphLaunch(drv_exe, drv_stream),
            "ctypes, libcuda": lambda: cu.cuGraphLaunch(exe_int, s),
        },
        "memcpy async (512 bytes, device to device)": {
            "cuda.bindings.runtime, int handles": lambda: runtime.cudaMemcpyAsync(d, sp, 512, default, s),
            "ctypes, libcuda": lambda: cu.cuMemcpyAsync(d, sp, 512, s),
        },
    }
    for what, ways in rows.items():
        for way, fn in ways.items():
            calls = n if "graph" not in what and "memcpy" not in what else n // 4  # keep the queue short
            print(f"{what:45s} {way:40s} {per_call_us(fn, calls):6.2f} us")
    runtime.cudaGraphExecDestroy(exe)
    runtime.cudaGraphDestroy(graph)
    runtime.cudaEventDestroy(event)


if __name__ == "__main__":
    main()
