"""The streamed dispatch kernel alone on one GPU, one rank sending to itself (its rings in local
memory, no NVLink): how fast its programs move rows, beside a flat copy of the same bytes.

    python tools/stream_kernel_cost.py [--channels 10 20] [--ring-rows 256] [--tokens 4096] [--fp8]
        [--warps 8] [--tokens-per-step 8] [--x-block 1024] [--publish 16] [--batch 16]

--warps, --tokens-per-step and --x-block take several values: every combination is timed.
"""

from __future__ import annotations

import argparse

import torch

from warmlink.ep.kernels import steps
from warmlink.ep.kernels.layout import dispatch_layout
from warmlink.ep.kernels import stream
from warmlink.ep.kernels.stream import Sources, StreamSpace, outputs, recv_offsets, row_words, stream_dispatch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", type=int, nargs="+", default=[10, 20, 32])
    ap.add_argument("--ring-rows", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warps", type=int, nargs="+", default=[stream.NUM_WARPS])
    ap.add_argument("--tokens-per-step", type=int, nargs="+", default=[stream.TILE_TOKENS])
    ap.add_argument("--x-block", type=int, nargs="+", default=[stream.X_BLOCK_WORDS])
    ap.add_argument("--publish", type=int, default=stream.PUBLISH_ROWS)
    ap.add_argument("--batch", type=int, default=stream.BATCH_ROWS)
    ap.add_argument("--fp8", action="store_true", help="FP8 rows with column-major float32 scales, as DeepEP's tests")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    t, h, k, experts = args.tokens, args.hidden, 8, 256
    topk = torch.randint(0, experts, (t, k), device=dev)
    lay = dispatch_layout(topk, experts, 1)
    rows, _ = steps.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, t)
    x = torch.randn(t, h, device=dev).to(torch.float8_e4m3fn if args.fp8 else torch.bfloat16)
    scales = torch.rand(h // 128, t, device=dev).T if args.fp8 else None  # column-major
    src = Sources(x.view(torch.int64), topk, torch.rand(t, k, device=dev), scales)
    flat = torch.empty_like(x.view(torch.uint8))  # (torch has no copy kernel for float8 types)
    runs = [(c, w, n, b) for c in args.channels for w in args.warps for n in args.tokens_per_step for b in args.x_block]
    for channels, warps, tile, block in runs:
        space = StreamSpace(1, channels, args.ring_rows, row_words(x.element_size() * h // 8, k, h // 128 if args.fp8 else 0))
        mem = torch.zeros(space.nbytes // 8, dtype=torch.int64, device=dev)
        bases = torch.tensor([mem.data_ptr()], dtype=torch.int64, device=dev)
        offsets, total = recv_offsets([t], dev)
        out = outputs(total, src, dev)
        status = torch.zeros(2 * channels, dtype=torch.int64, device=dev)
        times = []
        for seq in range(1, args.iterations + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            stream_dispatch(space, rows, src, out, offsets, bases, status, me=0, seq=seq, max_tokens=t,
                            experts_per_rank=experts, timeout_s=10.0, num_warps=warps, publish=args.publish,
                            batch=args.batch, tokens=tile, x_block=block)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        assert int(status.max() & ((1 << 32) - 1)) == 0, status
        assert torch.equal(out.x.view(x.dtype).view(torch.uint8), x.view(torch.uint8))
        med = sorted(times)[len(times) // 2]
        print(f"channels {channels:3d} warps {warps:2d} tile {tile:2d}x{block} ring {args.ring_rows} "
              f"publish {args.publish} batch {args.batch}: {med:8.1f} us  ({x.numel() * x.element_size() / med / 1e3:.0f} GB/s of rows, "
              f"{x.numel() * x.element_size() / med / 1e3 / channels:.1f} a channel)  space {space.nbytes / 2**20:.1f} MiB")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(args.iterations):
        flat.copy_(x.view(torch.uint8))
    b.record()
    torch.cuda.synchronize()
    print(f"flat copy of the rows: {a.elapsed_time(b) * 1e3 / args.iterations:.1f} us ({x.dtype})")


if __name__ == "__main__":
    main()
