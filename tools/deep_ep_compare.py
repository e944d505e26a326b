"""Compare ``warmlink bench ep --deep-ep --json`` records of two or more codes run in the same lease.

Usage: python tools/deep_ep_compare.py --code this='out/compare_deepep/this_*.json'
       --code previous='out/compare_deepep/previous_*.json' [--json record.json]

Each run holds DeepEP V1 and warmlink on the same calls, sampled in turn, so each run's ratio
(DeepEP / warmlink: above 1, warmlink is faster) compares the codes by what the run measured beside
itself, whatever the machine's speed did between runs. Prints, per call and budget, each code's
median DeepEP and warmlink times over its runs (CUDA events, us), the median of its runs' ratios
with their range, and the host clock's median ratio; ``--json`` writes every run and the medians
(the shape of the records in benchmarks/).
"""

from __future__ import annotations

import statistics

from _compare import code_table, compare_main, ratio_summary, records


def _runs(pattern: str) -> list[dict]:
    """Per run, ``{"call/budget": {"events": {...}, "host": {...}}}`` from its record's DeepEP table."""
    runs = []
    for path, record in records(pattern, "deep_ep_compare"):
        table = record["summary"].get("deepep_v1")
        if not isinstance(table, dict) or not table:
            raise SystemExit(f"deep_ep_compare: {path} holds no DeepEP table (was DeepEP V1 importable in that run?)")
        runs.append(table)
    return runs


def medians(runs: list[dict]) -> dict:
    """Per call of every run: median times (us) and ratios on both clocks, and the ratios' range."""
    out = {}
    for key in runs[0]:
        rows = [r[key] for r in runs if key in r]
        med = {clock: {"deepep_us": round(statistics.median(row[clock]["deepep_us"] for row in rows), 1),
                       "warmlink_us": round(statistics.median(row[clock]["warmlink_us"] for row in rows), 1),
                       **ratio_summary([row[clock]["ratio"] for row in rows])}
               for clock in ("events", "host")}
        out[key] = dict(med, runs=len(rows))
    return out


def _cell(m: dict) -> str:
    e = m["events"]
    lo, hi = e["ratio_range"]
    return (f"{e['deepep_us']:6.0f} /{e['warmlink_us']:6.0f} {e['ratio']:5.2f} [{lo:4.2f}-{hi:4.2f}] "
            f"h{m['host']['ratio']:4.2f} n{m['runs']}")


def _lines(med: dict) -> list[str]:
    return code_table("DeepEP / warmlink, events (us, median of runs) and the median of the runs' ratios [range]; "
                      "host ratio", "call/budget", 20, 40, med, _cell)


def main() -> None:
    compare_main(__doc__, _runs, medians, _lines)


if __name__ == "__main__":
    main()
