"""Where the host time of an eager low-latency call goes: a one-rank low-latency Buffer on GPU 0.

A one-rank group runs the same host path and the same kernels as a larger one (its rows go to
itself), so the host cost of each call shows without peers. Prints, per call (FP8 dispatch
without a hook, the hook's send and receive, BF16 combine), the median host time over ``--calls``
and the median of a synchronised call (host + device), then the top functions by own time::

    python tools/ll_host_profile.py [--calls 500] [--tokens 128] [--hidden 7168] [--experts 256]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from _one_rank import add_shape_args, one_rank_low_latency


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=500)
    add_shape_args(p)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--sort", default="tottime", help="pstats order: tottime (own time) or cumulative")
    args = p.parse_args()
    buf, store, x, idx, w = one_rank_low_latency(args, "ll-host-profile")
    with store:
        try:
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, args.tokens, args.experts)
            y = torch.randn(*recv[0].shape).bfloat16().cuda()
            hooks: list = []
            calls = {
                "dispatch (fp8)": lambda: buf.low_latency_dispatch(x, idx, args.tokens, args.experts),
                "dispatch send (hook)": lambda: hooks.append(buf.low_latency_dispatch(
                    x, idx, args.tokens, args.experts, return_recv_hook=True)[4]),
                "dispatch hook": lambda: hooks.pop()(),
                "combine (bf16)": lambda: buf.low_latency_combine(y, idx, w, handle),  # handle: set below
            }
            print(f"one rank, {args.tokens} tokens x {args.hidden}, top-{args.topk} of {args.experts}: median us")
            profiler = cProfile.Profile()
            for name, call in calls.items():
                if name == "dispatch hook":
                    continue
                if name.startswith("combine"):  # a handle of the last dispatch: the combines reuse it
                    handle = buf.low_latency_dispatch(x, idx, args.tokens, args.experts)[2]
                host, synced = [], []
                for i in range(args.calls):
                    if name == "dispatch send (hook)":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    if i >= args.calls // 2:
                        profiler.enable()
                    call()
                    profiler.disable()
                    host.append(time.perf_counter() - start)
                    if name == "dispatch send (hook)":
                        start = time.perf_counter()
                        if i >= args.calls // 2:
                            profiler.enable()
                        calls["dispatch hook"]()
                        profiler.disable()
                        host[-1] = (host[-1], time.perf_counter() - start)
                    torch.cuda.synchronize()
                    synced.append(time.perf_counter() - start)
                if name == "dispatch send (hook)":
                    sends, recvs = zip(*host)
                    for label, times in (("dispatch send", sends), ("dispatch hook", recvs)):
                        print(f"  {label:24s} host {statistics.median(times) * 1e6:7.1f} (min {min(times) * 1e6:6.1f})")
                else:
                    print(f"  {name:24s} host {statistics.median(host) * 1e6:7.1f} (min {min(host) * 1e6:6.1f})   "
                          f"host + device {statistics.median(synced) * 1e6:7.1f}")
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(args.sort).print_stats(args.top)
            print(out.getvalue())
        finally:
            buf.close()


if __name__ == "__main__":
    main()
