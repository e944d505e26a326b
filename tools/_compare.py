"""What the compare tools (``ep_compare.py``, ``deep_ep_compare.py``, ``ll_compare.py``) share:
reading a code's records, the command line of a code-by-code comparison, the ratios' summary and
the table with a column per code."""

from __future__ import annotations

import argparse
import glob
import json
import statistics


def records(pattern: str, tool: str) -> list[tuple[str, dict]]:
    """``(path, record)`` of each file ``pattern`` matches, in path order (the compare tools' input)."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise SystemExit(f"{tool}: no file matches {pattern!r}")
    return [(path, json.load(open(path))) for path in paths]


def compare_main(doc: str, runs, medians, lines) -> None:
    """A compare tool's command line: ``--code NAME=GLOB`` per code and ``--json``; ``runs(glob)``
    reads a code's runs, ``medians(runs)`` summarizes them, ``lines({code: medians})`` is the table."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", required=True, metavar="NAME=GLOB",
                   help="a code's name and the glob of its runs' records (repeat per code)")
    p.add_argument("--json", help="write the runs and medians here")
    args = p.parse_args()
    codes = dict(c.split("=", 1) for c in args.code)
    found = {name: runs(pattern) for name, pattern in codes.items()}
    med = {name: medians(r) for name, r in found.items()}
    print("\n".join(lines(med)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"codes": codes, "medians_of_runs": med, "runs": found}, f, separators=(",", ":"))


def ratio_summary(ratios: list[float]) -> dict:
    """The median of the runs' ratios and their range."""
    return {"ratio": round(statistics.median(ratios), 3), "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}


def code_table(title: str, label: str, label_width: int, cell_width: int, codes: dict[str, dict], cell) -> list[str]:
    """A row per key of the first code's medians, a column per code: ``cell(medians[key])``, or "-"
    where that code lacks the key."""
    lines = [title, f"{label:{label_width}s} " + "  ".join(f"{name:>{cell_width}s}" for name in codes)]
    for key in next(iter(codes.values())):
        cells = [cell(med[key]).rjust(cell_width) if key in med else f"{'-':>{cell_width}s}" for med in codes.values()]
        lines.append(f"{key:{label_width}s} " + "  ".join(cells))
    return lines
