"""DeepEP's eager "Dispatch + combine" timing loop (``tests/test_low_latency.py``'s ``test_func``
under ``utils.bench``: 50 calls to warm up, the L2 flushed, then 50 timed between CUDA events on
the caller's stream), one rank to itself on GPU 0, run by DeepEP V1 and by warmlink's
``deep_ep.Buffer`` in the same process, with the host's clock read around each call as well.

The events time the GPU from one iteration's start to its end, so a loop whose host keeps ahead
of the GPU measures the kernels, and one whose GPU drains waits for the host inside the timed
span. The host columns say which: ``iteration`` is the host's time from one start event to the
next, ``dispatch`` and ``combine`` each call's::

    PYTHONPATH=src:.baseline/deepep-v1 python tools/ll_eager_loop.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _one_rank import add_shape_args, deep_ep_sides, one_rank_low_latency

WARMUPS, TESTS = 50, 50


def _loop(buf, x, ids, w, y, stats, args) -> dict[str, list[float]]:
    """One run of DeepEP's ``bench`` over its ``test_func`` (no hooks): the event times and the
    host's per-iteration and per-call seconds of the timed iterations but the first (as DeepEP
    drops it)."""

    def test_func():
        handle = buf.low_latency_dispatch(x, ids, args.tokens, args.experts, cumulative_local_expert_recv_stats=stats,
                                          use_fp8=True, async_finish=False, return_recv_hook=False)[2]
        stamps.append(time.perf_counter())
        buf.low_latency_combine(y, ids, w, handle, use_logfmt=False, return_recv_hook=False)
        stamps.append(time.perf_counter())

    stamps: list[float] = []
    torch.cuda.synchronize()
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    for _ in range(WARMUPS):
        test_func()
    cache.zero_()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(TESTS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(TESTS)]
    stamps.clear()
    begins = []
    for i in range(TESTS):
        begins.append(time.perf_counter())
        starts[i].record()
        test_func()
        ends[i].record()
    begins.append(time.perf_counter())
    torch.cuda.synchronize()
    calls = stamps[0::2], stamps[1::2]
    return {
        "events": [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)][1:],
        "iteration": [b - a for a, b in zip(begins, begins[1:])][1:],
        "dispatch": [d - b for b, d in zip(begins, calls[0])][1:],
        "combine": [c - d for d, c in zip(calls[0], calls[1])][1:],
    }


def _row(name: str, t: dict[str, list[float]]) -> str:
    ev = t["events"]
    host = "".join(f"{statistics.median(t[k]) * 1e6:9.1f} {max(t[k]) * 1e6:7.1f}" for k in ("iteration", "dispatch",
                                                                                           "combine"))
    return (f"  {name:16s} {statistics.fmean(ev) * 1e6:7.1f} {min(ev) * 1e6:7.1f} {statistics.median(ev) * 1e6:7.1f} "
            f"{max(ev) * 1e6:7.1f} {host}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--no-deepep", action="store_true", help="warmlink alone, even where DeepEP is importable")
    add_shape_args(p)
    args = p.parse_args()
    buf, store, x, idx, w = one_rank_low_latency(args, "ll-eager-loop")
    with store:
        try:
            recv = buf.low_latency_dispatch(x, idx, args.tokens, args.experts)[0][0]
            y = torch.randn(*recv.shape, device=x.device).bfloat16()
            stats = torch.zeros(recv.shape[0], dtype=torch.int32, device=x.device)
            with deep_ep_sides(x, idx, args) as deep_sides:
                sides = deep_sides or {"warmlink ep": (buf, idx)}
                if not deep_sides:
                    print("DeepEP V1 is not importable: warmlink's ep.Buffer alone")
                print(f"one rank, {args.tokens} tokens x {args.hidden}, top-{args.topk} of {args.experts}; DeepEP's "
                      f"eager loop, {TESTS - 1} timed iterations a run; us")
                print(f"  {'':16s} {'events: avg':>11s} {'min':>7s} {'median':>7s} {'max':>7s}"
                      f"   host: iteration (max)  dispatch (max)  combine (max)")
                for _ in range(args.rounds):
                    for side, (b, ids) in sides.items():
                        print(_row(side, _loop(b, x, ids, w, y, stats, args)), flush=True)
        finally:
            buf.close()


if __name__ == "__main__":
    main()
