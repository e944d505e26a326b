"""Host time of one launch of each ep kernel at the bench shapes (median of 200), beside a torch
index_select: what each step costs the CPU before the copy engines can start (device machine)."""

import statistics
import time

import torch

from warmlink.ep.kernels import steps as _kernels
from warmlink.ep.kernels.layout import dispatch_layout


def host_us(fn, n=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


dev = torch.device("cuda", 0)
T, H, E, K, R = 4096, 7168, 256, 8, 4
topk = torch.rand(T, E, device=dev).argsort(1)[:, :K].contiguous()
lay = dispatch_layout(topk, E, R)
rows, words = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, T)
x = torch.randn(T, H, device=dev).to(torch.bfloat16).view(torch.int64)
out = torch.empty(R * T, x.shape[1], dtype=torch.int64, device=dev)
meta = torch.empty(R * T, 320, dtype=torch.uint8, device=dev)
src = _kernels.Sources(x, topk, torch.rand(T, K, device=dev))
idx = torch.empty(T, K, dtype=torch.int64, device=dev)
index = torch.arange(0, T, 2, device=dev)
print(f"plan launch: {host_us(lambda: _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, T)):.1f} us")
print(f"gather launch, one destination, x only: {host_us(lambda: _kernels.gather(rows, _kernels.Sources(x), out, None, K, range(1, 2))):.1f} us")
print(f"gather launch, all peers, x + ids + weights: {host_us(lambda: _kernels.gather(rows, src, out, meta, K, range(R), skip=0)):.1f} us")
print(f"unpack launch: {host_us(lambda: _kernels.unpack(meta[:T], K, idx, None, None, 0, 64)):.1f} us")
print(f"torch index_select launch: {host_us(lambda: torch.index_select(x, 0, index, out=out[:T // 2])):.1f} us")
