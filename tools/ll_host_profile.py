"""Host time of eager low-latency calls, one rank to itself on GPU 0, for warmlink and, where
DeepEP V1 is importable, for DeepEP on the same inputs in the same process; then where warmlink's
time goes.

A one-rank group runs the same host path and the same kernels as a larger one (its rows go to
itself), so the host cost of each call shows without peers, and DeepEP's low-latency Buffer runs
with one rank too (NVSHMEM with one PE): a same-run baseline for the host paths. Beside DeepEP,
warmlink is timed twice: its ``ep.Buffer``, and ``warmlink.ep.deep_ep.Buffer`` (what DeepEP's
callers call, and ``bench ep --low-latency``). Each iteration
starts every call from an idle GPU: a dispatch's send with a hook, the hook, a combine's send with
a hook, its hook, then a dispatch and a combine without hooks (FP8 dispatch, BF16 combine). Per
side and call the median (min) host time over ``--calls`` is printed; ``--rounds`` alternates the
sides (a host's speed drifts within a lease). Then the top functions, by own time, of warmlink's
``--profile`` call, profiled in a pass of its own after the timed rounds::

    PYTHONPATH=src:.baseline/deepep-v1 python tools/ll_host_profile.py [--calls 400] [--rounds 2] [--profile hook]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from _one_rank import add_shape_args, deep_ep_sides, one_rank_low_latency

CALLS = ("dispatch send (hook)", "dispatch hook", "combine send (hook)", "combine hook", "dispatch", "combine")


def _time(buf, x, idx, w, y, args, profiler: cProfile.Profile | None) -> dict[str, list[float]]:
    """Per call of ``CALLS``, the host seconds of each of ``args.calls`` iterations; ``profiler``
    records ``args.profile``'s calls."""
    times: dict[str, list[float]] = {name: [] for name in CALLS}

    def timed(name: str, fn, *call_args, **kwargs):
        profiling = profiler is not None and name == args.profile
        if profiling:
            profiler.enable()
        start = time.perf_counter()
        result = fn(*call_args, **kwargs)
        times[name].append(time.perf_counter() - start)
        if profiling:
            profiler.disable()
        return result

    for _ in range(args.calls):
        torch.cuda.synchronize()
        sent = timed("dispatch send (hook)", buf.low_latency_dispatch, x, idx, args.tokens, args.experts,
                     return_recv_hook=True)
        timed("dispatch hook", sent[4])
        torch.cuda.synchronize()
        timed("combine hook", timed("combine send (hook)", buf.low_latency_combine, y, idx, w, sent[2],
                                    return_recv_hook=True)[2])
        torch.cuda.synchronize()
        handle = timed("dispatch", buf.low_latency_dispatch, x, idx, args.tokens, args.experts)[2]
        torch.cuda.synchronize()
        timed("combine", buf.low_latency_combine, y, idx, w, handle)
    torch.cuda.synchronize()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", default="dispatch", choices=CALLS, help="the call whose cProfile is printed")
    p.add_argument("--no-deepep", action="store_true", help="warmlink alone, even where DeepEP is importable")
    add_shape_args(p)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    buf, store, x, idx, w = one_rank_low_latency(args, "ll-host-profile")
    with store:
        try:
            recv = buf.low_latency_dispatch(x, idx, args.tokens, args.experts)[0][0]
            y = torch.randn(*recv.shape, device=x.device).bfloat16()
            with deep_ep_sides(x, idx, args) as deep_sides:
                sides = {"warmlink": (buf, idx), **deep_sides}
                if deep_sides:
                    facade = deep_sides["warmlink deep_ep"][0]
                    facade.low_latency_dispatch(x, idx, args.tokens, args.experts)  # (builds it)
                print(f"one rank, {args.tokens} tokens x {args.hidden}, top-{args.topk} of {args.experts}, FP8 "
                      f"dispatch, BF16 combine; host time per call, median (min) of {args.calls}, us")
                print(f"  {'':16s} " + "".join(f"{name:>22s}" for name in CALLS))
                for _ in range(args.rounds):
                    for side, (b, ids) in sides.items():
                        times = _time(b, x, ids, w, y, args, None)
                        print(f"  {side:16s} " + "".join(
                            f"{statistics.median(t) * 1e6:13.1f} ({min(t) * 1e6:5.1f})" for t in times.values()))
                # A pass of its own: a profiled call runs several times slower and would skew a round's figures
                profiler = cProfile.Profile()
                _time(buf, x, idx, w, y, args, profiler)
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
                print(f"warmlink's {args.profile}, profiled in a pass after the timed rounds:\n{out.getvalue()}")
        finally:
            buf.close()


if __name__ == "__main__":
    main()
