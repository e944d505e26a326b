"""Which copy method moves a model's tensors fastest within one GPU (the colocated refit's pull).

Allocates the refit bench's tensors (Qwen3-4B shape, 290 bf16 tensors, separate allocations, as a
trainer holds them) and one flat destination, then times in one process, on one stream:

* flat:    one cudaMemcpyAsync of all the bytes (the ceiling the bench calls the copy peak);
* loop:    ``dst_i.copy_(src_i)`` per tensor;
* foreach: ``torch._foreach_copy_``;
* batch:   one ``cudaMemcpyBatchAsync`` of the 290 copies (warmlink's cuda_ipc path);
* kernel:  warmlink's multi-copy kernel (``transport._copy_kernel``), per chunk size.

Medians of ``--repeats`` timed runs after warm-up (CUDA events), GB/s one way, and each as a
fraction of flat. Usage: python3 tools/colocated_copy.py [--scale 1.0] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--chunks", default="262144,1048576,4194304", help="kernel chunk sizes, bytes")
    p.add_argument("--variants", default="v1,v2,v3", help="kernel variants (transport._copy_kernel.get_kernel)")
    p.add_argument("--warps", default="4,8", help="num_warps values")
    args = p.parse_args()

    from warmlink import _cuda
    from warmlink.bench.model_spec import qwen3_4b_like
    from warmlink.transport import _copy_kernel

    torch.cuda.set_device(0)
    spec = qwen3_4b_like(args.scale)
    layouts = spec.layouts(1, 0)
    srcs = [torch.randn(lay.shape, device="cuda").to(torch.bfloat16) for lay in layouts.values()]
    sizes = [t.numel() * t.element_size() for t in srcs]
    total = sum(sizes)
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += (n + 255) // 256 * 256
    dst = torch.empty(at, dtype=torch.uint8, device="cuda")
    dst_views = [dst[o : o + n].view(torch.bfloat16).view(t.shape) for o, n, t in zip(offsets, sizes, srcs)]
    flat_src = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(args.repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream())
            fn()
            stop.record(torch.cuda.current_stream())
            stop.synchronize()
            out.append(start.elapsed_time(stop) / 1e3)
        return statistics.median(out)

    rows = {}
    rows["flat"] = timed(lambda: dst[:total].copy_(flat_src))

    def loop():
        for d, s in zip(dst_views, srcs):
            d.copy_(s)

    rows["loop"] = timed(loop)
    rows["foreach"] = timed(lambda: torch._foreach_copy_(dst_views, srcs))

    copies = [(d.data_ptr(), t.data_ptr(), n) for d, t, n in zip(dst_views, srcs, sizes)]
    lists = ([c[0] for c in copies], [c[1] for c in copies], [c[2] for c in copies])

    def batched():
        cur = torch.cuda.current_stream()
        stream.wait_stream(cur)
        _cuda.memcpy_batch_async(*lists, stream.cuda_stream)
        cur.wait_stream(stream)

    rows["batch"] = timed(batched)
    want = torch.cat([t.reshape(-1).view(torch.uint8) for t in srcs])
    kcopies = [(d, s_, n, 1, 0, 0) for d, s_, n in copies]
    for chunk in (int(c) for c in args.chunks.split(",")):
        plan = _copy_kernel.CopyPlan(kcopies, device=0, chunk_nbytes=chunk)
        assert not plan.rest, plan.rest[:3]
        for variant in args.variants.split(","):
            for warps in (int(w) for w in args.warps.split(",")):
                name = f"kernel {variant} w{warps} {chunk >> 10}K"
                dst.zero_()
                plan.launch(variant=variant, num_warps=warps)
                got = torch.cat([d.reshape(-1).view(torch.uint8) for d in dst_views])
                if not torch.equal(got, want):
                    bad = [i for i, (d, t) in enumerate(zip(dst_views, srcs)) if not torch.equal(d, t)]
                    print(f"{name}: WRONG in {len(bad)} tensors, first {bad[:5]}")
                    continue
                rows[name] = timed(lambda: plan.launch(variant=variant, num_warps=warps))

    flat = rows["flat"]
    print(f"{len(srcs)} tensors, {total / 1e9:.3f} GB, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'method':<18} {'ms':>8} {'GB/s':>8} {'of flat':>8}")
    for name, s in rows.items():
        print(f"{name:<18} {s * 1e3:8.3f} {total / s / 1e9:8.1f} {flat / s:8.3f}")


if __name__ == "__main__":
    main()
