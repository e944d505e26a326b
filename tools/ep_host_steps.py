"""Host time of each step of one ep call, by wall clock: a one-rank Buffer on one GPU.

cProfile charges its own overhead to every Python call, which hides how the 50-150 us before a
send's launch split. This wraps a few named steps with ``time.perf_counter`` instead (about 0.3 us
each) and prints, per kind of call, the median inclusive host time of each step per call (a step
that nests another includes it), beside the call's own median wall time. The first calls of each
kind are printed apart: they compile kernels, run eagerly once per receive parity, then capture
the CUDA graphs later calls replay (ep.paths.sm_pushes, Note [Fresh send graph]), all paid once per
Buffer and shape::

    python tools/ep_host_steps.py [--calls 300]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from _one_rank import one_rank
from _timing import timed

from warmlink import _cuda
from warmlink.ep.paths import cuda_mover as _cuda_mover
from warmlink.ep.paths import outputs as _outputs
from warmlink.ep.paths import senders as _senders
from warmlink.ep.protocol import checks as _checks
from warmlink.ep.protocol import normal as _normal
from warmlink.ep.protocol import rounds as _rounds
from warmlink.ep.wire import mailbox as _mailbox

# (owner, attribute): the steps timed; module-level functions are patched where the caller looks them up
STEPS = [
    (_checks.Checks, "x"), (_checks.Checks, "routing"), (torch, "empty"), (_senders.SmPath, "_shape"),
    (_mailbox.Mailbox, "publish_dispatch"), (_senders, "call_words"), (_cuda_mover.CudaMover, "send_sm"),
    (_cuda_mover.CudaMover, "_launch"), (_cuda, "event_record"), (_cuda, "graph_launch"),
    (_cuda_mover.CudaMover, "wait_board"), (_checks.Checks, "counts"), (_rounds.Rounds, "meet"),
    (_normal, "plan_from_board"), (_cuda_mover.CudaMover, "send_done"), (_mailbox.Mailbox, "publish"),
    (_normal, "dispatch_outputs"), (_cuda_mover.CudaMover, "arrived"), (_outputs, "unpack_meta"),
    (_cuda_mover.CudaMover, "_push_cached"), (_cuda, "stream_wait_value"), (_cuda, "stream_write_value"), (_senders.SmPath, "send_cached"),
    (_cuda_mover.CudaMover, "gather_all"), (_cuda_mover.CudaMover, "flush_all"),
]

_spent: collections.Counter = collections.Counter()


def _spend(name: str, entered: float, left: float) -> None:
    _spent[name] += left - entered


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    args = p.parse_args()
    buf, store, x, kw = one_rank(args.tokens, args.hidden, "ep-host-steps")
    t0 = time.perf_counter()
    handle = buf.dispatch(x, **kw)[4]
    torch.cuda.synchronize()
    print(f"first fresh dispatch of the Buffer (compiles its kernels): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    hooks: list = []
    calls = {
        "fresh dispatch": lambda: buf.dispatch(x, **kw),
        "cached dispatch": lambda: buf.dispatch(x, handle=handle),
        "cached dispatch, hook send": lambda: hooks.append(buf.dispatch(x, handle=handle, return_recv_hook=True)[-1]),
    }
    for owner, attr in STEPS:
        name = f"{getattr(owner, '__name__', owner)}.{attr}".replace("warmlink.", "")
        setattr(owner, attr, timed(name, getattr(owner, attr), _spend))
    for kind, fn in calls.items():
        per_step: dict[str, list[float]] = collections.defaultdict(list)
        wall, first = [], []
        for i in range(args.calls + 20):
            _spent.clear()
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            while hooks:
                hooks.pop()()
            torch.cuda.synchronize()
            if i < 6:
                first.append(elapsed)
            if i >= 20:  # warm-up calls compile and capture
                wall.append(elapsed)
                for name, seconds in _spent.items():
                    per_step[name].append(seconds)
        print(f"=== {kind}: host wall {statistics.median(wall) * 1e6:.1f} us median of {args.calls} (one rank); "
              f"first calls {', '.join(f'{s * 1e3:.2f}' for s in first)} ms")
        for name, samples in sorted(per_step.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"  {name:40s} {statistics.median(samples) * 1e6:7.1f} us")
    buf.close()
    store.close()


if __name__ == "__main__":
    main()
