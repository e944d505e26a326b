"""The GPU kernels and copies of a chrome trace (torch.profiler's ``export_chrome_trace``), summed by
name: count, total and median microseconds, in order of total time.

    python tools/trace_kernels.py trace.json [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            spans[e["name"][:90]].append(float(e.get("dur", 0)))
    print(f"{'count':>6}{'total us':>11}{'median us':>11}  name")
    for name, durs in sorted(spans.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"{len(durs):>6}{sum(durs):>11.1f}{statistics.median(durs):>11.1f}  {name}")


if __name__ == "__main__":
    main()
