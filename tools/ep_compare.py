"""Compare ``warmlink bench ep --json`` records of two or more codes run in the same lease.

Usage: python tools/ep_compare.py --code this='benchmarks/ep_*_this*.json' --code previous='...'
       [--baseline 'torch+NCCL combine (bf16)']

Prints, per operation (and per call's host time until it returns, where the records hold it), each
code's median time over its runs and the median over runs of the time divided by the same run's
baseline (an unchanged operation), so that a machine whose speed swings between runs compares
codes by what each run measured beside itself. Rows that some run lacks are left out. With ``--quantiles``
it prints each code's minimum, first quartile and median instead: on a machine whose runs fall
into a fast and a slow mode, the lower statistics compare the fast runs.
"""

from __future__ import annotations

import argparse
import statistics

from _compare import records


def _records(pattern: str) -> list[dict]:
    """Per run, ``{operation: ms}``: the timed operations, then the host time until each call
    returns (idle, behind queued device work, with late peers) and the async_finish overlap rows,
    where the record has them."""
    runs = []
    for _, record in records(pattern, "ep_compare"):
        summary = record["summary"]
        run = {k: v["ms"] for k, v in summary.items() if isinstance(v, dict) and "ms" in v}
        for key, when in (("returns_ms", "idle"), ("returns_busy_ms", "behind work"), ("returns_late_ms", "peers late")):
            run.update({f"returns, {when}: {call.replace('_', ' ')}": ms for call, ms in summary.get(key, {}).items()})
        for name in ("combine", "cached"):  # a call then a GEMM, inline and with async_finish (device time)
            timed = summary.get(f"async_{name}", {})
            run.update({f"async_finish {name}: {k.removesuffix('_ms')}": ms for k, ms in timed.items() if k.endswith("_ms")})
        runs.append(run)
    return runs


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated between the two nearest."""
    at = (len(ordered) - 1) * q
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", action="append", required=True, metavar="NAME=GLOB",
                   help="a code's name and the glob of its JSON records (give two or more)")
    p.add_argument("--baseline", default="torch+NCCL combine (bf16)",
                   help="the operation each run's times are divided by (default: %(default)s)")
    p.add_argument("--quantiles", action="store_true", help="print min, first quartile and median per code")
    args = p.parse_args()
    codes = dict(c.split("=", 1) for c in args.code)
    runs = {name: _records(pattern) for name, pattern in codes.items()}
    ops = [op for op in next(iter(runs.values()))[0] if all(op in r for rs in runs.values() for r in rs)]
    names = list(runs)
    if args.quantiles:
        print(f"runs: {', '.join(f'{n} {len(r)}' for n, r in runs.items())}; ms: min / q25 / median per code")
        for op in ops:
            cells = []
            for n in names:
                ms = sorted(r[op] for r in runs[n])
                cells.append(f"{ms[0]:.3f} / {_quantile(ms, 0.25):.3f} / {statistics.median(ms):.3f}")
            print(f"{op[:40]:40s} " + " | ".join(f"{n} {c}" for n, c in zip(names, cells)))
        return
    print(f"runs: {', '.join(f'{n} {len(r)}' for n, r in runs.items())}; ms median | median ratio to {args.baseline!r}")
    print(f"{'operation':40s} " + " ".join(f"{n:>10s}" for n in names) + " | " + " ".join(f"{n:>10s}" for n in names))
    for op in ops:
        ms = [statistics.median(r[op] for r in runs[n]) for n in names]
        ratio = [statistics.median(r[op] / r[args.baseline] for r in runs[n]) for n in names]
        print(f"{op[:40]:40s} " + " ".join(f"{m:10.3f}" for m in ms) + " | " + " ".join(f"{x:10.2f}" for x in ratio))


if __name__ == "__main__":
    main()
