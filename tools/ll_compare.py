"""Compare ``warmlink bench ep --low-latency --json`` records of two or more codes run in one lease.

Usage: python tools/ll_compare.py --code this='out/compare_ll/this_*.json'
       --code previous='out/compare_ll/previous_*.json' [--json record.json]

Each run holds DeepEP V1 and warmlink on the same inputs (where DeepEP was importable), so each
run's ratio (DeepEP / warmlink: above 1, warmlink is faster) compares the codes by what the run
measured beside itself, whatever the machine did between runs. Prints, per operation, each code's
median warmlink and DeepEP times over its runs (us, slowest rank's median) and the median of its
runs' ratios with their range; without DeepEP, the warmlink times alone.
"""

from __future__ import annotations

import statistics

from _compare import code_table, compare_main, ratio_summary, records


def _runs(pattern: str) -> list[dict]:
    """Per run, ``{op: (warmlink_us, deepep_us or None)}`` from its record's summary."""
    runs = []
    for _, record in records(pattern, "ll_compare"):
        summary = record["summary"]
        ours, theirs = (summary["warmlink"], summary["deepep_v1"]) if "warmlink" in summary else (summary, {})
        runs.append({op: (row["median_us"], theirs[op]["median_us"] if op in theirs else None)
                     for op, row in ours.items()})
    return runs


def medians(runs: list[dict]) -> dict:
    """Per operation: the median over runs of warmlink's and DeepEP's times, and of the runs' ratios."""
    out = {}
    for op in runs[0]:
        rows = [r[op] for r in runs if op in r]
        row = {"warmlink_us": round(statistics.median(w for w, _ in rows), 1), "runs": len(rows)}
        if all(d is not None for _, d in rows):
            row.update(deepep_us=round(statistics.median(d for _, d in rows), 1),
                       **ratio_summary([d / w for w, d in rows]))
        out[op] = row
    return out


def _cell(m: dict) -> str:
    if "ratio" not in m:
        return f"{m['warmlink_us']:7.1f} n{m['runs']}"
    lo, hi = m["ratio_range"]
    return f"{m['warmlink_us']:7.1f} /{m['deepep_us']:7.1f} {m['ratio']:5.2f} [{lo:4.2f}-{hi:4.2f}] n{m['runs']}"


def table(codes: dict[str, dict]) -> list[str]:
    """The printed table of ``{code: medians(...)}``."""
    return code_table("warmlink / DeepEP V1 (us, median of runs), DeepEP / warmlink median of the runs' ratios [range]",
                      "operation", 24, 36, codes, _cell)


def main() -> None:
    compare_main(__doc__, _runs, medians, table)


if __name__ == "__main__":
    main()
