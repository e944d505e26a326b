"""Device time of low-latency calls replayed from CUDA graphs, one rank to itself on GPU 0.

A one-rank group runs the same kernels as a larger one with every row staying on the GPU: what
a kernel change costs or saves in its own work (casts, scans, copies, waits), without a link and
without the host. Captures a dispatch (send and receive in one kernel), a dispatch's send and its
hook, and a combine; then each phase of a dispatch and a combine in hook mode in a graph of its
own (the sends and the hooks apart); prints each one's median over ``--iterations`` replays (CUDA
events)::

    python tools/ll_replay_time.py [--iterations 200] [--tokens 128] [--hidden 7168] [--experts 256]

Run two codes in one lease with ``PYTHONPATH`` naming each one's ``src`` in turn.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _one_rank import add_shape_args, one_rank_low_latency


def _replays(graph: torch.cuda.CUDAGraph, iterations: int) -> float:
    """Median microseconds of one replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iterations):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _phases(buf, x, idx, w, y, out, args) -> dict[str, float]:
    """Median us of each hook-mode phase replayed alone, in call order (each send's rows arrived
    before its hook replays)."""
    phases = {name: torch.cuda.CUDAGraph() for name in ("dispatch send alone", "dispatch hook alone",
                                                         "combine send alone", "combine hook alone")}
    graphs = iter(phases.values())
    with torch.cuda.graph(next(graphs)):
        sent = buf.low_latency_dispatch(x, idx, args.tokens, args.experts, return_recv_hook=True)
    with torch.cuda.graph(next(graphs)):
        sent[4]()
    with torch.cuda.graph(next(graphs)):
        hook = buf.low_latency_combine(y, idx, w, sent[2], out=out, return_recv_hook=True)[2]
    with torch.cuda.graph(next(graphs)):
        hook()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in phases}
    for _ in range(args.iterations):
        for name, graph in phases.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=200)
    add_shape_args(p)
    args = p.parse_args()
    buf, store, x, idx, w = one_rank_low_latency(args, "ll-replay-time")
    with store:
        try:
            for _ in range(4):  # both parities of each kind of call compiled and launched before capture
                recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, args.tokens, args.experts)
                buf.low_latency_dispatch(x, idx, args.tokens, args.experts, return_recv_hook=True)[4]()
            y = torch.randn(*recv[0].shape).bfloat16().cuda()
            out = torch.empty_like(x)
            for _ in range(2):
                handle = buf.low_latency_dispatch(x, idx, args.tokens, args.experts)[2]
                buf.low_latency_combine(y, idx, w, handle, out=out)
            torch.cuda.synchronize()
            graphs = {name: torch.cuda.CUDAGraph() for name in ("dispatch", "dispatch send + hook", "combine")}
            with torch.cuda.graph(graphs["dispatch"]):
                handle = buf.low_latency_dispatch(x, idx, args.tokens, args.experts)[2]
            with torch.cuda.graph(graphs["dispatch send + hook"]):
                buf.low_latency_dispatch(x, idx, args.tokens, args.experts, return_recv_hook=True)[4]()
            with torch.cuda.graph(graphs["combine"]):
                buf.low_latency_combine(y, idx, w, handle, out=out)
            print(f"one rank, {args.tokens} tokens x {args.hidden}, top-{args.topk} of {args.experts}, FP8 dispatch: "
                  "median us of a replay")
            for name, graph in graphs.items():
                print(f"  {name:24s} {_replays(graph, args.iterations):7.1f}")
            for name, median in _phases(buf, x, idx, w, y, out, args).items():
                print(f"  {name:24s} {median:7.1f}")
        finally:
            buf.close()


if __name__ == "__main__":
    main()
