"""Where a deep_ep dispatch in rounds spends its time: one rank, DeepEP's hint-sized budget.

``warmlink.ep.deep_ep.Buffer`` sends a batch larger than its budget holds in several rounds
(deep_ep.rounds, Note [Rounds beyond the budget]). One rank runs the same per-round host path as a
group (layout, the fresh dispatch's count copy and host wait, the copy out, the placing) without
the peers' noise. Prints the rounds, the median wall time of a fresh dispatch, a cached one and a
combine beside the same calls on a budget that holds the batch, and the top functions by own time
of the fresh dispatches in rounds (the host waits for the device show as ``wait_board`` /
``wait_host``)::

    python tools/deep_ep_rounds_profile.py [--tokens 16384] [--hidden 7168] [--calls 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist


def _timed(fn, calls: int, sync) -> float:
    out = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--hint-ranks", type=int, default=2,
                   help="the group size whose DeepEP hint is the budget (DeepEP's tables start at 2; default 2)")
    args = p.parse_args()

    import warmlink.ep.deep_ep as deep_ep
    from warmlink.ep.deep_ep.sizing import needed_bytes

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(args.experts, generator=gen)[:args.topk] for _ in range(args.tokens)])
    topk_idx = topk_idx.to(device, deep_ep.topk_idx_t)
    weights = torch.rand(args.tokens, args.topk, generator=gen).to(device)
    n = args.hint_ranks
    hint = max(c.get_nvl_buffer_size_hint(args.hidden * 2, n)
               for c in (deep_ep.Buffer.get_dispatch_config(n), deep_ep.Buffer.get_combine_config(n)))
    try:
        for name, budget in (("hint", hint), ("batch", needed_bytes(args.tokens, 1, args.hidden, args.topk))):
            with deep_ep.Buffer(dist.group.WORLD, budget) as buf:
                lay = buf.get_dispatch_layout(topk_idx, args.experts)
                kw = {"num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2],
                      "topk_idx": topk_idx, "topk_weights": weights}
                recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kw)
                rounds = len(handle.rounds) if handle.rounds is not None else 1
                fresh = _timed(lambda: buf.dispatch(x, **kw), args.calls, sync)
                cached = _timed(lambda: buf.dispatch(x, handle=handle), args.calls, sync)
                combine = _timed(lambda: buf.combine(recv_x, handle, topk_weights=recv_w), args.calls, sync)
                print(f"{name} budget {budget / 2**20:.1f} MiB, {rounds} rounds: fresh {fresh * 1e3:.3f} ms, "
                      f"cached {cached * 1e3:.3f} ms, combine {combine * 1e3:.3f} ms")
                if name == "hint":
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.calls):
                        buf.dispatch(x, **kw)
                    sync()
                    prof.disable()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
                    print(f"fresh dispatches in rounds, {args.calls} calls, by own time:")
                    print("\n".join(out.getvalue().splitlines()[:args.top + 12]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
