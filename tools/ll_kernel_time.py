"""Kernel times of low-latency calls replayed from CUDA graphs, one rank to itself on GPU 0, for
warmlink and, where DeepEP V1 is importable, for DeepEP on the same inputs in the same process.

DeepEP's low-latency kernels run with one rank (NVSHMEM with one PE), so one GPU gives a
same-run baseline for the kernels' own work: what a send or a receive costs without a link. Each
side captures a dispatch + hook and a combine + hook in graphs (with ``--one-launch``, a dispatch
and a combine without hooks too), replays them in turn under the torch profiler (CUPTI sees each
kernel of a replay; with ``--flush-l2``, after zeroing 256 MB, as DeepEP's tests time kernels)
and prints, per graph, the median span from the first kernel's start to the last one's end and
each kernel's median duration and the gap before it::

    PYTHONPATH=src:.baseline/deepep-v1 python tools/ll_kernel_time.py [--replays 200] [--rounds 2] \
        [--one-launch] [--flush-l2]

``--rounds`` alternates the two sides that many times (the GPU's clocks drift between leases,
not within one). Without DeepEP (or with ``--no-deepep``) only warmlink's rows are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
from _one_rank import add_shape_args, one_rank_deep_ep, one_rank_low_latency

from warmlink.bench.ep_low_latency import capture_decode_step


def _capture(buf, x, idx, w, y, args) -> dict[str, torch.cuda.CUDAGraph]:
    """A decode step's graphs by name, both parities launched eagerly first: with hooks, and with
    ``--one-launch`` without (a kernel a call, with ``cumulative_local_expert_recv_stats`` as DeepEP's
    test passes it) too."""
    for _ in range(4):
        sent = buf.low_latency_dispatch(x, idx, args.tokens, args.experts, use_fp8=True, return_recv_hook=True)
        sent[4]()
        buf.low_latency_combine(y, idx, w, sent[2], return_recv_hook=True)[2]()
    torch.cuda.synchronize()
    graphs = dict(zip(("dispatch + hook", "combine + hook"),
                      capture_decode_step(buf, x, idx, w, y, args.tokens, args.experts), strict=True))
    if args.one_launch:  # as DeepEP's test_low_latency.py times them: with the receive's expert stats
        out = torch.empty_like(x)
        stats = torch.zeros(args.experts, dtype=torch.int32, device=x.device)
        graphs["dispatch"], graphs["combine"] = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs["dispatch"]):
            handle = buf.low_latency_dispatch(x, idx, args.tokens, args.experts, use_fp8=True,
                                              cumulative_local_expert_recv_stats=stats)[2]
        with torch.cuda.graph(graphs["combine"]):
            buf.low_latency_combine(y, idx, w, handle, out=out)
    return graphs


def _calls(graphs: dict[str, torch.cuda.CUDAGraph], replays: int,
           flush: torch.Tensor | None = None) -> dict[str, list[list[dict]]]:
    """Per graph, the GPU operations of each of its ``replays`` replays: the graphs replayed in turn
    (a dispatch, then a combine, as a decode step calls them: each finds the caches the other
    left; with ``flush``, a buffer larger than L2 zeroed before each, as DeepEP's tests time
    their kernels), each replay synchronised, so that its kernels are apart from the next one's."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            for graph in graphs.values():
                if flush is not None:
                    flush.zero_()
                    torch.cuda.synchronize()
                graph.replay()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
                  and (flush is None or "FillFunctor" not in e.get("name", ""))), key=lambda e: e["ts"])
    calls: list[list[dict]] = []
    for op in ops:  # a replay's operations follow each other within microseconds; replays are a sync apart
        if calls and op["ts"] - (calls[-1][-1]["ts"] + calls[-1][-1]["dur"]) < 5:
            calls[-1].append(op)
        else:
            calls.append([op])
    # each replay by its kernels' names (both sides name theirs ...dispatch... and ...combine...)
    return {name: [c for c in calls if name.split()[0] in c[0]["name"]] for name in graphs}


def _report(side: str, name: str, calls: list[list[dict]]) -> None:
    width = statistics.mode(len(c) for c in calls)  # the calls that split apart are left out
    calls = [c for c in calls if len(c) == width]
    span = statistics.median(c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls)
    parts = []
    for i in range(width):
        label = calls[0][i]["name"].removeprefix("void ").split("(")[0].split("<")[0]
        part = f"{label} {statistics.median(c[i]['dur'] for c in calls):.1f}"
        if i:
            part += f" (after a gap of {statistics.median(c[i]['ts'] - c[i - 1]['ts'] - c[i - 1]['dur'] for c in calls):.1f})"
        parts.append(part)
    print(f"  {side:9s} {name:17s} {span:6.1f}   {'; '.join(parts)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-deepep", action="store_true", help="warmlink alone, even where DeepEP is importable")
    p.add_argument("--one-launch", action="store_true",
                   help="also the calls without a hook (a kernel each: sends and receives in one launch)")
    p.add_argument("--flush-l2", action="store_true",
                   help="zero 256 MB before each replay, so that every call starts with cold caches (as DeepEP's "
                        "tests time kernels, and as a decode step's MoE layer follows other work)")
    add_shape_args(p)
    args = p.parse_args()
    buf, store, x, idx, w = one_rank_low_latency(args, "ll-kernel-time")
    y = torch.randn(args.experts, args.tokens, args.hidden, device=x.device).bfloat16()
    with store:
        try:
            sides = {"warmlink": _capture(buf, x, idx, w, y, args)}
            deep_buf, id_dtype = one_rank_deep_ep(x, args)
            if deep_buf is not None:
                sides["DeepEP V1"] = _capture(deep_buf, x, idx.to(id_dtype), w, y, args)
            print(f"one rank, {args.tokens} tokens x {args.hidden}, top-{args.topk} of {args.experts}, FP8 dispatch, "
                  f"BF16 combine; medians of {args.replays} graph replays{', L2 flushed before each' * args.flush_l2}"
                  ", us")
            print(f"  {'':9s} {'graph':17s} {'span':>6s}   kernels (duration, gap before)")
            flush = torch.empty(256 << 20, dtype=torch.uint8, device=x.device) if args.flush_l2 else None
            for _ in range(args.rounds):
                for side, graphs in sides.items():
                    # the hook graphs, then the one-launch ones, each pair profiled alone: a replay's
                    # kernels are told apart by their names
                    for pair in (list(graphs.items())[i:i + 2] for i in range(0, len(graphs), 2)):
                        _calls(dict(pair), 5, flush)  # warm
                        for name, calls in _calls(dict(pair), args.replays, flush).items():
                            _report(side, name, calls)
            if deep_buf is not None:
                deep_buf.destroy()
                dist.destroy_process_group()
        finally:
            buf.close()


if __name__ == "__main__":
    main()
