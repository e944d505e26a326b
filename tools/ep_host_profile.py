"""Where the host time of one ep call goes: cProfile of a one-rank Buffer on one GPU.

A one-rank group runs the same host path as a larger one up to the peer loops (checks, plan,
gathers, the count copy, the unpack, the sums), so the functions that cost host time before the
first copy show here without the peers' noise. Prints the top functions by own time for fresh
dispatches, cached dispatches and combines, and the median wall time of each call::

    python tools/ep_host_profile.py [--calls 300]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from _one_rank import TOPK, one_rank

from warmlink.ep import Buffer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sort", default="tottime", help="pstats order: tottime (own time) or cumulative")
    args = p.parse_args()
    buf, store, x, kw = one_rank(args.tokens, args.hidden, "ep-host-profile")
    y, _, _, _, handle, _ = buf.dispatch(x, **kw)
    y = y.clone()

    def on_buffer(**options):  # a fresh dispatch on a second Buffer, built with other options
        try:
            other = Buffer(store, 0, 1, max_tokens_per_rank=args.tokens, hidden=args.hidden, num_topk=TOPK,
                           timeout_s=30, **options)
        except TypeError:  # a version of warmlink before these options (timed beside this one)
            return None
        others.append(other)
        return other, lambda: other.dispatch(x, **kw)

    others: list = []
    calls = {  # name: (the Buffer whose marks and phases it reports, the call)
        "fresh dispatch": (buf, lambda: buf.dispatch(x, **kw)),
        "fresh dispatch, eager launches": on_buffer(graphs=False),
        "fresh dispatch, copy engines": on_buffer(send="copy"),
        "cached dispatch": (buf, lambda: buf.dispatch(x, handle=handle)),
        # the send phase alone (what delays work queued between send and hook); the hook runs untimed
        "cached dispatch, hook send": (buf, lambda: hooks.append(buf.dispatch(x, handle=handle,
                                                                              return_recv_hook=True)[-1])),
        "combine": (buf, lambda: buf.combine(y, handle)),
    }
    hooks: list = []

    def settle() -> None:
        while hooks:
            hooks.pop()()
        torch.cuda.synchronize()

    for name, call in calls.items():
        if call is None:
            print(f"=== {name}: this version of ep.Buffer has no such option")
            continue
        on, fn = call
        for _ in range(20):
            fn()
            settle()
        wall, marks = [], []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t0)
            settle()
            marks.append({k: v - on.last_marks["start"] for k, v in on.last_marks.items()})
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
            settle()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(args.sort).print_stats(args.top)
        print(f"=== {name}: host wall {statistics.median(wall) * 1e6:.1f} us median of {args.calls} (one rank); "
              f"phases {({k: round(v * 1e6, 1) for k, v in on.last_phases.items()})} us")
        print("marks after start (us, median): " + ", ".join(
            f"{k} {statistics.median(m[k] for m in marks) * 1e6:.1f}" for k in marks[0]))
        print(text.getvalue())
    for b in (*others, buf):
        b.close()
    store.close()


if __name__ == "__main__":
    main()
