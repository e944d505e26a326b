"""Where a streamed Buffer's call spends its time on one GPU, one rank (``send="stream"``): each
call's host time and device time (CUDA events around it), then a torch profile of a few calls.

    python tools/stream_call_profile.py [--tokens 4096] [--hidden 7168] [--iterations 20] [--trace out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--trace", default=None, help="write a chrome trace of three calls of each kind here")
    ap.add_argument("--host-profile", action="store_true", help="cProfile each kind's timed calls (host functions)")
    args = ap.parse_args()
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    t, h, k, experts = args.tokens, args.hidden, 8, 256
    dev = torch.device("cuda", 0)
    topk = torch.stack([torch.randperm(experts, device=dev)[:k] for _ in range(t)])
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    w = torch.rand(t, k, device=dev)
    store = Store(is_server=True, prefix="stream-profile", timeout_s=30)
    with Buffer(store, 0, 1, max_tokens_per_rank=t, hidden=h, num_topk=k, device=0, send="stream", timeout_s=30) as buf:
        lay = buf.get_dispatch_layout(topk, experts)
        kwargs = {"topk_idx": topk, "topk_weights": w, "num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3],
                  "num_tokens_per_expert": lay[2]}
        out = buf.dispatch(x, **kwargs)
        handle, y = out[4], out[0].clone()
        calls = {"fresh": lambda: buf.dispatch(x, **kwargs),
                 "fresh padded": lambda: buf.dispatch(x, **kwargs, num_worst_tokens=t),
                 "cached": lambda: buf.dispatch(x, handle=handle),
                 "combine": lambda: buf.combine(y, handle, topk_weights=out[2])}
        for name, fn in calls.items():
            host, device, marks = [], [], []
            profiler = None
            if args.host_profile:
                import cProfile

                profiler = cProfile.Profile()
            for _ in range(args.iterations):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                a.record()
                if profiler is not None:
                    profiler.enable()
                fn()
                if profiler is not None:
                    profiler.disable()
                b.record()
                host.append(time.perf_counter() - t0)
                marks.append({k: v - t0 for k, v in buf.last_marks.items()} if name != "combine" else {})
                torch.cuda.synchronize()
                device.append(a.elapsed_time(b) / 1e3)
            print(f"{name:<14} host {statistics.median(host) * 1e6:8.1f} us   events {statistics.median(device) * 1e6:8.1f} us"
                  "   marks (us after the call began): " + ", ".join(
                      f"{k} {statistics.median(m[k] for m in marks) * 1e6:.0f}" for k in marks[-1]))
            if profiler is not None:
                import pstats

                pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
        if args.trace:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for fn in calls.values():
                    for _ in range(3):
                        fn()
                        torch.cuda.synchronize()
            prof.export_chrome_trace(args.trace)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    store.close()


if __name__ == "__main__":
    main()
