"""Where a receiver's first refit cycle spends its time: cProfile of cycle 1 (and cycle 2 beside it).

A publisher process (``bench.refit``'s, on ``--src``) exports the refit bench's model; this process
is the receiver (on ``--dst``) and runs its first cycles under ``cProfile``, printing each cycle's
phases and the functions that took longest in cycle 1; with ``--export`` the publisher's
``export()`` is profiled too and printed first. Usage:
    python3 tools/refit_first_cycle_profile.py [--src 0] [--dst 1] [--scale 1.0] [--install swap] [--top 35] [--export]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pstats
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=int, default=0)
    p.add_argument("--dst", type=int, default=1)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--install", default="swap")
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--export", action="store_true", help="profile the publisher's export() too")
    args = p.parse_args()

    import torch

    from warmlink.bench import refit as bench_refit
    from warmlink.bench.model_spec import qwen3_4b_like
    from warmlink.refit import Receiver
    from warmlink.rendezvous import Store

    spec = qwen3_4b_like(args.scale)
    prefix = f"profile-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix) as store:
        control, results = ctx.Queue(), ctx.Queue()
        pub = ctx.Process(target=_profiled_publisher if args.export else bench_refit._publisher, kwargs=dict(
            control=control, results=results, address=store.address, secret=store.secret, prefix=prefix, spec=spec,
            tp=1, rank=0,
            device_idx=args.src, pool_on=True, backend=None, seed=0))
        pub.start()
        try:
            ready = results.get(timeout=300)
            print(f"publisher ready: export {ready['export_s'] * 1e3:.1f} ms")
            if args.export:
                print(results.get(timeout=60)["profile"])
            torch.cuda.set_device(args.dst)
            layouts = spec.layouts(1, 0)
            with Receiver(store, num_publishers=1, install=args.install) as rec:
                for name, layout in layouts.items():
                    rec.add(name, layout, torch.empty(layout.local_shape, dtype=getattr(torch, layout.dtype),
                                                      device=f"cuda:{args.dst}"))
                prof = cProfile.Profile()
                prof.enable()
                first = rec.refit()
                prof.disable()
                second = rec.refit()
            for report in (first, second):
                phases = {k: round(v * 1e3, 2) for k, v in report.as_dict().items() if k.endswith("_s")}
                print(f"cycle {report.cycle} (ms): {phases}")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
        finally:
            control.put(None)
            pub.join(timeout=60)
            if pub.is_alive():
                pub.kill()


def _profiled_publisher(*, results, top=35, **kwargs) -> None:
    """``bench.refit._publisher`` with ``Publisher.export`` under cProfile: its stats are put on
    ``results`` after the ready message."""
    import io

    from warmlink.bench import refit as bench_refit
    from warmlink.refit import Publisher

    export = Publisher.export
    prof = cProfile.Profile()

    class _Results:
        def put(self, msg):
            results.put(msg)
            if msg.get("event") == "ready":
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
                results.put({"profile": out.getvalue()})

    def profiled(self):
        prof.enable()
        try:
            return export(self)
        finally:
            prof.disable()

    Publisher.export = profiled
    bench_refit._publisher(results=_Results(), **kwargs)


if __name__ == "__main__":
    main()
