"""Where a fresh dispatch of the DeepEP drop-in spends its time, beside ep.Buffer's own call.

Two ranks, one per GPU, the bench's inputs (4096 tokens x 7168, top-8 of 256), a 2e9 budget (one
round). Times on CUDA events on the caller's stream, medians of ``--calls``: ``get_dispatch_layout``
alone, ``dispatch`` given a layout, both (DeepEP's fresh dispatch), and the warmlink Buffer inside
called with the same layout; then a torch profiler table of rank 0's fresh dispatches::

    python tools/deep_ep_fresh_profile.py [--calls 30] [--ranks 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from _spawn import spawn_ranks


def _rank(rank: int, num_ranks: int, port: int, calls: int) -> None:
    import warmlink.ep.deep_ep as deep_ep
    from warmlink.bench._ep_routing import routing

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank))
    x, topk_idx, weights = routing(rank, 4096, 256, 8, 7168, torch.device("cuda", rank))
    buf = deep_ep.Buffer(dist.group.WORLD, int(2e9), explicitly_destroy=True)
    lay = buf.get_dispatch_layout(topk_idx, 256)
    kw = {"num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2],
          "topk_idx": topk_idx, "topk_weights": weights}
    buf.dispatch(x, **kw)
    inner = buf.warmlink_buffer

    def fresh():
        l2 = buf.get_dispatch_layout(topk_idx, 256)
        return buf.dispatch(x, num_tokens_per_rank=l2[0], is_token_in_rank=l2[3], num_tokens_per_expert=l2[2],
                            topk_idx=topk_idx, topk_weights=weights)

    flag = torch.zeros(1, device="cuda")

    def events(fn) -> float:
        begin, end, samples = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
        for i in range(calls + 5):
            dist.all_reduce(flag)
            torch.cuda.synchronize()
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                samples.append(begin.elapsed_time(end) * 1e3)
        return statistics.median(samples)

    rows = {"layout alone": events(lambda: buf.get_dispatch_layout(topk_idx, 256)),
            "dispatch given a layout": events(lambda: buf.dispatch(x, **kw)),
            "fresh (layout + dispatch)": events(fresh),
            "inner ep.Buffer dispatch, same layout": events(lambda: inner.dispatch(x, **kw))}
    if rank == 0:
        for name, us in rows.items():
            print(f"{name:<40}{us:>10.0f} us", flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                dist.all_reduce(flag)
                torch.cuda.synchronize()
                fresh()
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
    else:
        for _ in range(5):
            dist.all_reduce(flag)
            torch.cuda.synchronize()
            fresh()
            torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    spawn_ranks(_rank, args.ranks, args.calls)

if __name__ == "__main__":
    main()
