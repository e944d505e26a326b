"""The streamed Buffer (``send="stream"``) at several channel counts and ring sizes, one rank per
GPU (``--ranks 1``: one rank sending to itself): per configuration the median of each call (fresh
dispatch, cached dispatch, combine; CUDA events on the caller's stream) on the slowest rank, and
the space each rank holds.

    python tools/stream_sweep.py [--configs 20x128 32x64 20x128/p64/b32] [--tokens 4096] [--hidden 7168] [--graph]
                                 [--fp8] [--ranks N]

A config is CHANNELSxRING_ROWS, optionally with /pN (a sender's tail every N rows, PUBLISH_ROWS),
/bN (the most rows a receiver takes from a source per visit, BATCH_ROWS) and /wN (warps a program),
for the dispatch and the combine alike, /tN (tokens a step, TILE_TOKENS) and /xN (int64 words
of a row a step, X_BLOCK_WORDS) for the dispatch alone (/w, /t and /x: the Triton kernels only),
and /mN (dispatch channels a combine program takes: the CUDA kernels' combine_merge).
``WARMLINK_EP_STREAM_KERNEL`` picks the kernels; ``--define UNROLL=4`` compiles the CUDA ones with
that macro (ep/kernels/stream.cu). ``--fp8`` dispatches FP8 tokens with column-major scales, as
DeepEP's tests pass them (the combine still sums BF16 rows).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.multiprocessing as mp


def _parse(config: str) -> tuple[int, int, dict]:
    shape, *knobs = config.split("/")
    channels, ring = (int(v) for v in shape.split("x"))
    names = {"p": "publish", "b": "batch", "w": "num_warps", "t": "tokens", "x": "x_block", "m": "merge"}
    return channels, ring, {names[k[0]]: int(k[1:]) for k in knobs}


DISPATCH_ONLY = ("tokens", "x_block")


def _knobs(kwargs: dict):
    """Patch the stream kernels' launches (as ep.paths.streamed calls them) with ``kwargs``."""
    from warmlink.ep.kernels import stream, stream_combine, stream_cuda

    originals = stream.stream_dispatch, stream_combine.stream_combine, dict(stream_cuda.STEPS), stream_cuda.combine_merge
    if "merge" in kwargs:
        merge = kwargs.pop("merge")
        stream_cuda.combine_merge = lambda num_ranks, channels: merge
    both = {k: v for k, v in kwargs.items() if k not in DISPATCH_ONLY}
    stream.stream_dispatch = lambda *a, **k: originals[0](*a, **{**k, **kwargs})
    stream_combine.stream_combine = lambda *a, **k: originals[1](*a, **{**k, **both})
    stream_cuda.STEPS.update({k: v for k, v in kwargs.items() if k in stream_cuda.STEPS})  # the CUDA kernels' knobs
    return lambda: (setattr(stream, "stream_dispatch", originals[0]),
                    setattr(stream_combine, "stream_combine", originals[1]), stream_cuda.STEPS.update(originals[2]),
                    setattr(stream_cuda, "combine_merge", originals[3]))


def _rank(rank: int, world: int, address: str, secret: str, args, queue) -> None:
    from warmlink.ep import Buffer
    from warmlink.ep.kernels import stream_cuda
    from warmlink.rendezvous import Store

    stream_cuda.OPTIONS = tuple(f"-D{d}" for d in args.define)
    torch.cuda.set_device(rank % torch.cuda.device_count())  # (--ranks past the GPUs: they share them)
    t, h, k, experts = args.tokens, args.hidden, 8, 256
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    scores = torch.rand(t, experts, device="cuda", generator=gen)
    topk = scores.topk(k, dim=1).indices
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    if args.fp8:
        from warmlink.ep.wire.fp8 import quantize

        values, scales = quantize(x)
        x = (values, scales.T.contiguous().T)
    w = torch.rand(t, k, device="cuda", generator=gen)
    rows = []  # one per config, in order (a config may be given twice: a second Buffer of it)
    with Store.connect(address, prefix="stream-sweep", timeout_s=60, secret=secret) as store:
        for config in args.configs:
            channels, ring, kwargs = _parse(config)
            restore = _knobs(kwargs)
            with Buffer(store, rank, world, max_tokens_per_rank=t, hidden=h, num_topk=k,
                        device=torch.cuda.current_device(), send="stream", stream_channels=channels, ring_rows=ring,
                        timeout_s=60) as buf:
                lay = buf.get_dispatch_layout(topk, experts)
                kwargs = {"topk_idx": topk, "topk_weights": w, "num_tokens_per_rank": lay[0],
                          "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2]}
                out = buf.dispatch(x, **kwargs)
                handle = out[4]
                y = (out[0][0].float() if args.fp8 else out[0]).to(torch.bfloat16)
                calls = {"fresh": lambda: buf.dispatch(x, **kwargs), "cached": lambda: buf.dispatch(x, handle=handle),
                         "combine": lambda: buf.combine(y, handle, topk_weights=out[2])}
                row = {}
                for name, fn in calls.items():
                    times = []
                    for i in range(args.iterations + 3):
                        torch.cuda.synchronize()
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        fn()
                        b.record()
                        torch.cuda.synchronize()
                        if i >= 3:
                            times.append(a.elapsed_time(b) * 1e3)
                    row[name] = statistics.median(times)
                if args.graph:  # the same calls replayed from CUDA graphs: the device's time without the host's
                    for name in ("cached", "combine"):
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            calls[name]()
                        times = []
                        for i in range(args.iterations + 3):
                            torch.cuda.synchronize()
                            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            a.record()
                            graph.replay()
                            b.record()
                            torch.cuda.synchronize()
                            if i >= 3:
                                times.append(a.elapsed_time(b) * 1e3)
                        row[f"{name} graph"] = statistics.median(times)
                rows.append(row)
            restore()
    queue.put((rank, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["20x128", "32x64", "48x32", "64x32"],
                    help="CHANNELSxRING_ROWS each")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--graph", action="store_true",
                    help="also time cached dispatch and combine replayed from CUDA graphs")
    ap.add_argument("--fp8", action="store_true", help="dispatch FP8 tokens (column-major scales)")
    ap.add_argument("--ranks", type=int, default=0,
                    help="ranks (default: one per visible GPU). 1 times the kernels of a rank sending to itself, "
                         "with no link; ranks sharing a GPU take turns on it (processes without MPS), so their "
                         "times are not the kernels'")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a macro for the CUDA kernels' compile, e.g. UNROLL=4 (repeatable)")
    args = ap.parse_args()
    from warmlink.rendezvous import Store

    gpus = torch.cuda.device_count()
    world = args.ranks or gpus
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with Store(is_server=True, prefix="stream-sweep", timeout_s=60) as server:
        procs = [ctx.Process(target=_rank, args=(r, world, server.address, server.secret, args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=540) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    where = "one per GPU" if world <= gpus else f"sharing {gpus} GPU(s), taking turns"
    print(f"streamed Buffer, {world} ranks ({where}), {args.tokens} tokens x {args.hidden} "
          f"{'FP8 (BF16 combine)' if args.fp8 else 'BF16'}, top-8 of 256; "
          "slowest rank's median, us")
    kinds = ("fresh", "cached", "combine") + (("cached graph", "combine graph") if args.graph else ())
    print(f"{'config':>16}" + "".join(f"{k:>15}" for k in kinds))
    for i, config in enumerate(args.configs):
        print(f"{config:>16}" + "".join(f"{max(results[r][i][k] for r in results):>15.0f}" for k in kinds))


if __name__ == "__main__":
    main()
