"""What two processes copying on one GPU at once cost, against one process copying the same bytes.

The colocated TP 1 -> 2 refit has two receiver processes on the trainer's GPU, each pulling half of
the model at the same moment. Without MPS the GPU runs one process's kernels at a time and switches
between them; this tool measures what that switching costs, apart from refit:

* one:        one process copies both halves (two launches, one stream);
* concurrent: two processes, each copying one half, released by one barrier;
* serialized: the same two processes, the second starting when the first has finished.

Each copy is one flat device-to-device copy (``copy``) or warmlink's multi-copy kernel over the
half cut into 1 MiB rows (``kernel``, Note [Copy kernel]). Wall time from the release to the last
process done, median of ``--repeats``; GB/s one way for all the bytes.
Usage: python3 tools/colocated_contention.py [--gb 8.82] [--repeats 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

ROW = 1 << 20


def _half(nbytes: int, method: str):
    """A copy of ``nbytes`` on the current device, as a zero-argument launcher."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    if method == "copy":
        return lambda: dst.copy_(src)
    from warmlink.transport._copy_kernel import CopyPlan

    plan = CopyPlan([(dst.data_ptr() + o, src.data_ptr() + o, min(ROW, nbytes - o), 1, 0, 0)
                     for o in range(0, nbytes, ROW)], device=0, chunk_nbytes=128 << 10)
    plan.compile()
    keep = (src, dst)
    return lambda: (plan.launch(), keep)


def _worker(index: int, nbytes: int, method: str, repeats: int, go, turn, times) -> None:
    torch.cuda.set_device(0)
    launch = _half(nbytes, method)
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    for mode in ("concurrent", "serialized"):
        for r in range(repeats):
            go.wait(timeout=120)
            if mode == "serialized" and index == 1:
                turn.wait(timeout=120)
                turn.clear()
            start = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            times.put((mode, r, index, start, time.perf_counter()))
            if mode == "serialized" and index == 0:
                turn.set()
            go.wait(timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=8.82, help="bytes copied in all, GB (10^9)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--methods", default="copy,kernel")
    args = p.parse_args()
    half = int(args.gb * 1e9 / 2) // 4096 * 4096
    ctx = mp.get_context("spawn")
    for method in args.methods.split(","):
        torch.cuda.set_device(0)
        launches = [_half(half, method), _half(half, method)]
        for _ in range(3):
            for launch in launches:
                launch()
        torch.cuda.synchronize()
        one = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for launch in launches:
                launch()
            torch.cuda.synchronize()
            one.append(time.perf_counter() - start)
        del launches
        torch.cuda.empty_cache()

        go, turn, times = ctx.Barrier(3), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(i, half, method, args.repeats, go, turn, times), daemon=True)
                 for i in range(2)]
        for proc in procs:
            proc.start()
        for _ in range(2 * args.repeats):
            go.wait(timeout=300)
            go.wait(timeout=300)
        records = [times.get(timeout=60) for _ in range(4 * args.repeats)]
        for proc in procs:
            proc.join(timeout=60)
        walls = {"one": one}
        for mode in ("concurrent", "serialized"):
            walls[mode] = []
            for r in range(args.repeats):
                rs = [x for x in records if x[0] == mode and x[1] == r]
                walls[mode].append(max(x[4] for x in rs) - min(x[3] for x in rs))
        base = statistics.median(one)
        for mode, values in walls.items():
            t = statistics.median(values)
            print(f"{method:6s} {mode:10s} {t * 1e3:8.3f} ms  {2 * half / t / 1e9:7.1f} GB/s  one/this {base / t:.3f}")


if __name__ == "__main__":
    main()
