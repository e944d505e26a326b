"""Comparing two resource snapshots of a process, for the churn tests (CPU and GPU)."""

from __future__ import annotations


def growth(before: dict, after: dict, exact: tuple[str, ...], may_shrink: tuple[str, ...] = ()) -> dict:
    """What changed between two snapshots; empty when nothing did.

    ``before["pool"]`` maps each pool kind to ``(live, idle)``, which must not change; so must
    the counts named in ``exact``. Those in ``may_shrink`` (device memory the driver may give
    back) may only go down.
    """
    out = {}
    for kind in sorted(set(before["pool"]) | set(after["pool"])):
        b, a = before["pool"].get(kind, (0, 0)), after["pool"].get(kind, (0, 0))
        if a != b:
            out[f"pool[{kind}] (live, idle)"] = (b, a)
    for key in exact:
        if after[key] != before[key]:
            out[key] = (before[key], after[key])
    for key in may_shrink:
        if after[key] > before[key]:
            out[key] = (before[key], after[key])
    return out
