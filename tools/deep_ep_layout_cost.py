"""Where ``deep_ep.Buffer.get_dispatch_layout``'s time goes on one GPU (one rank): CUDA events on
the caller's stream around a zeroing alone, ``ep.kernels.layout.dispatch_layout`` (the kernel and its
zeroing) and the drop-in's call (its checks and stream context around them), medians of
``--calls``; then cProfile of the drop-in's call, by own time::

    python tools/deep_ep_layout_cost.py [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import socket
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import warmlink.ep.deep_ep as deep_ep
    from warmlink.ep.kernels.layout import dispatch_layout

    torch.cuda.set_device(0)
    topk = torch.randint(0, 256, (4096, 8), device="cuda")
    buf = deep_ep.Buffer(dist.group.WORLD, 1 << 24, explicitly_destroy=True)

    def events(fn) -> float:
        begin, end, samples = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
        for i in range(args.calls + 10):
            torch.cuda.synchronize()
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i >= 10:
                samples.append(begin.elapsed_time(end) * 1e3)
        return statistics.median(samples)

    for name, fn in (("zeros(257) alone", lambda: torch.zeros(257, dtype=torch.int32, device="cuda")),
                     ("ep.kernels.layout.dispatch_layout", lambda: dispatch_layout(topk, 256, 1)),
                     ("deep_ep get_dispatch_layout", lambda: buf.get_dispatch_layout(topk, 256))):
        print(f"{name:<32}{events(fn):>8.1f} us", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        buf.get_dispatch_layout(topk, 256)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    buf.destroy()


if __name__ == "__main__":
    main()
