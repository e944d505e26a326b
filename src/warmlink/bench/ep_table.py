"""The table and summary record of ``warmlink bench ep`` from its ranks' results (bench.ep)."""

from __future__ import annotations

import statistics

__all__ = ["OPS", "table"]

# "_copy": normal mode through the copy engines (a Buffer with send="copy"), beside the default SM sends
# "_eager": the same SM sends launched one kernel at a time (graphs=False) instead of as graphs
# "_one_part", "_two_parts", "_four_parts": the combine's sum after its last byte, or part by part
# (combine_parts; ep.kernels.reduce, Note [Pipelined combine]), whatever the group's default
# "_stream": a Buffer with send="stream" (a fixed space the GPUs pace, ep.paths.streamed); on CPU the default stands in
OPS = ("dispatch_bf16", "dispatch_bf16_eager", "dispatch_bf16_hook", "dispatch_bf16_copy", "dispatch_bf16_stream",
       "dispatch_fp8", "dispatch_fp8_hook", "dispatch_fp8_stream", "dispatch_cached", "dispatch_cached_eager",
       "dispatch_cached_copy", "dispatch_cached_stream", "combine_bf16", "combine_bf16_hook", "combine_bf16_stream",
       "combine_bf16_one_part", "combine_bf16_two_parts", "combine_bf16_four_parts")


def table(cfg: dict, ranks: list[dict]) -> tuple[list[str], dict]:
    """Lines to print and the summary record: per op the slowest rank's median and its GB/s."""
    from warmlink.bench.ep_deep_ep import BUDGET_NAMES, BUDGETS, CALLS
    from warmlink.ep.api.diagnostics import FLOOR_SCHEDULES, PUSH_SCHEDULES

    def worst(get):
        return max(get(r) for r in ranks)

    lines = [(f"ep bench: {cfg['ranks']} ranks ({'GPU, cuda_ipc' if cfg['cuda'] else 'CPU, shm'}), {cfg['tokens']} tokens x "
             f"{cfg['hidden']}, top-{cfg['topk']} of {cfg['experts']} experts; medians of {cfg['iterations']}, slowest rank"),
             f"bytes per rank that cross to other ranks (bf16 dispatch): {statistics.mean(r['bytes']['bf16'] for r in ranks) / 1e6:.1f} MB",
             "bytes per rank received, own rows included (DeepEP's count): "
             f"{statistics.mean(r['recv_rows'] for r in ranks) * cfg['hidden'] * 2 / 1e6:.1f} MB",
             "rank processes: " + (f"each pinned to {len(ranks[0]['cores'])} cores of its own" if ranks[0].get("cores")
                                   else "not pinned") + f"; torch intra-op threads per rank: {ranks[0].get('threads', '?')}",
             "", f"{'operation':<40}{'time (ms)':>11}{'GB/s per rank':>15}{'DeepEP count':>14}{'vs NCCL':>9}"]
    summary: dict = {}
    nccl = {"dispatch": worst(lambda r: r["nccl"]["dispatch_s"]), "combine": worst(lambda r: r["nccl"]["combine_s"]),
            "a2a": worst(lambda r: r["nccl"]["a2a_s"])}

    def row(name, t, nbytes, deepep_bytes, base):
        gbs, deepep = nbytes / t / 1e9, deepep_bytes / t / 1e9
        summary[name] = {"ms": t * 1e3, "gb_s": gbs, "gb_s_deepep_count": deepep, **({"vs_nccl": base / t} if base else {})}
        lines.append(f"{name:<40}{t * 1e3:>11.3f}{gbs:>15.1f}{deepep:>14.1f}{(f'{base / t:.2f}x' if base else ''):>9}")

    from warmlink.ep.wire.fp8 import num_scales

    H = cfg["hidden"]
    b16 = min(r["bytes"]["bf16"] for r in ranks)
    b8 = min(r["bytes"]["fp8"] for r in ranks)
    bc = min(r["combine_bytes"] for r in ranks)
    received = min(r["recv_rows"] for r in ranks)
    d16, d8 = received * H * 2, received * (H + num_scales(H) * 4)
    for op in OPS:
        nbytes, deepep = (bc, d16) if op.startswith("combine") else ((b8, d8) if "fp8" in op else (b16, d16))
        base = nccl["combine"] if op.startswith("combine") else nccl["dispatch"]
        row(f"warmlink {op.replace('_', ' ')}", worst(lambda r, op=op: r["times_s"][op]), nbytes, deepep, base)
    row("torch+NCCL dispatch (bf16)", nccl["dispatch"], b16, d16, None)
    row("torch+NCCL combine (bf16)", nccl["combine"], bc, d16, None)
    row("NCCL all_to_all_single, same bytes", nccl["a2a"], b16, d16, None)
    if "deep_ep_s" in ranks[0]:
        for budget in BUDGETS:
            rounds = ranks[0]["deep_ep_s"][budget]["rounds"]
            what = f"{rounds} round{'s' if rounds > 1 else ''}"
            for op in CALLS:
                nbytes, base = ((bc, nccl["combine"]) if op.startswith("combine") else
                                (b8 if "fp8" in op else b16, None if op.startswith("cached") else nccl["dispatch"]))
                row(f"deep_ep {op.replace('_', ' ')}, {BUDGET_NAMES[budget]} ({what})",
                    worst(lambda r, b=budget, o=op: r["deep_ep_s"][b][o]["host"]), nbytes, d8 if "fp8" in op else d16, base)
    if "deepep_v1_s" in ranks[0]:
        lines += _beside_deepep(ranks, summary, worst)
    if "floor_s" in ranks[0]:
        for name in FLOOR_SCHEDULES:
            row(f"copy engines alone, {name}", worst(lambda r, name=name: r["floor_s"][name]), b16, d16, None)
    if "push_s" in ranks[0]:
        for name in PUSH_SCHEDULES:
            row(f"SM stores alone, {name}", worst(lambda r, name=name: r["push_s"][name]), b16, d16, None)
    if "sum_alone" in ranks[0]:
        slowest = max(ranks, key=lambda r: r["sum_alone"]["s"])["sum_alone"]
        moved = (slowest["read"] + slowest["written"]) / 1e6
        lines.append(f"combine's sum alone (device, slowest rank): {slowest['s'] * 1e3:.3f} ms for {moved:.0f} MB read "
                     f"and written ({moved / 1e3 / slowest['s']:.0f} GB/s of HBM)")
    lines.append("")
    for key, what in (("dispatch_phases_s", "dispatch"), ("cached_phases_s", "cached dispatch"),
                      ("combine_phases_s", "combine")):
        for r in ranks:
            if key in r:
                lines.append(f"{what} phases, rank {r['rank']} (host ms): "
                             + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in r[key].items()))
    for key, when in (("returns_s", "idle device"), ("returns_busy_s", "behind ~1 ms of device work"),
                      ("returns_late_s", "every peer of rank 0 ~1 ms late (the slowest rank: rank 0)")):
        if key in ranks[0]:
            summary[key[:-2] + "_ms"] = got = {k: worst(lambda r, k=k: r[key][k]) * 1e3 for k in ranks[0][key]}
            lines.append(f"host time until the call returns, {when} (ms): "
                         + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in got.items()))
    # the same marks on one clock: median over iterations of (mark - earliest start of any rank)
    n = min(len(r["dispatch_marks"]) for r in ranks)
    for r in ranks:
        rel = {k: statistics.median(r["dispatch_marks"][i][k] - min(q["dispatch_marks"][i]["start"] for q in ranks)
                                    for i in range(n)) for k in r["dispatch_marks"][0]}
        lines.append(f"  rank {r['rank']} marks after the first start (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in rel.items()))
    if "overlap_s" in ranks[0]:
        for name, which, alone, together in (("overlap", "hook dispatch", "dispatch_hook", "send_gemm_hook"),
                                             ("overlap_cached", "hook cached dispatch", "cached_hook",
                                              "send_gemm_hook_cached")):
            g, d, both = (worst(lambda r, k=k: r["overlap_s"][k]) for k in ("gemm", alone, together))
            summary[name] = {"gemm_ms": g * 1e3, "dispatch_ms": d * 1e3, "together_ms": both * 1e3, "ratio": both / max(g, d)}
            lines.append(f"{name.replace('_', ', ')}: GEMM {g * 1e3:.3f} ms, {which} {d * 1e3:.3f} ms, send -> GEMM -> hook "
                         f"{both * 1e3:.3f} ms = {both / max(g, d):.2f} x the longer (goal <= 1.15)")
    if "combine_async_gemm" in ranks[0].get("overlap_s", {}):
        for name in ("combine", "cached"):
            g, alone, inline, both = (worst(lambda r, k=k: r["overlap_s"][k])
                                      for k in ("gemm", f"{name}_alone", f"{name}_gemm", f"{name}_async_gemm"))
            summary[f"async_{name}"] = {"gemm_ms": g * 1e3, "call_ms": alone * 1e3, "inline_ms": inline * 1e3,
                                        "async_ms": both * 1e3, "ratio": both / inline}
            what = "combine" if name == "combine" else "cached dispatch"
            lines.append(f"async_finish, {what}: GEMM {g * 1e3:.3f} ms, {what} {alone * 1e3:.3f} ms; {what} then GEMM "
                         f"{inline * 1e3:.3f} ms, with async_finish {both * 1e3:.3f} ms = {both / inline:.2f} x")
    if "overlap" in ranks[0].get("deep_ep_s", {}).get("large", {}):
        g, c, inline, beside = (worst(lambda r, k=k: r["deep_ep_s"]["large"]["overlap"][k]["host"])
                                for k in ("gemm", "combine", "combine_then_gemm", "gemm_beside"))
        summary["deep_ep_overlap"] = {"gemm_ms": g * 1e3, "combine_ms": c * 1e3, "inline_ms": inline * 1e3,
                                      "beside_ms": beside * 1e3, "ratio": beside / inline}
        lines.append(f"deep_ep, GEMM queued before an async combine (previous_event): GEMM {g * 1e3:.3f} ms, combine "
                     f"{c * 1e3:.3f} ms; combine then GEMM {inline * 1e3:.3f} ms, GEMM beside the combine "
                     f"{beside * 1e3:.3f} ms = {beside / inline:.2f} x")
    for r in ranks:
        for kind, p in r.get("overlap_parts_s", {}).items():
            lines.append(f"  {kind} send -> GEMM -> hook, rank {r['rank']} (ms): send {p['send'] * 1e3:.3f}, hook "
                         f"{p['hook'] * 1e3:.3f} (host); GEMM {p['gemm_between'] * 1e3:.3f} between them, "
                         f"{p['gemm_alone'] * 1e3:.3f} alone (device)")
    checks = {k: all(r["checks"][k] for r in ranks) for k in ranks[0]["checks"]}
    summary["checks"] = checks
    summary["init_s"] = max(r["init_s"] for r in ranks)
    lines.append(f"outputs equal to the NCCL path's: {checks}; Buffer init (slowest rank) {summary['init_s'] * 1e3:.1f} ms")
    return lines, summary


def _beside_deepep(ranks: list[dict], summary: dict, worst) -> list[str]:
    """DeepEP V1 and the drop-in on the same inputs, per call and budget, on both clocks: the
    slowest rank's median, and DeepEP's time over warmlink's (above 1: warmlink is faster)."""
    from warmlink.bench.ep_deep_ep import BUDGET_NAMES, BUDGETS, CALLS

    lines = ["", "DeepEP V1 beside warmlink.ep.deep_ep, same inputs, same run (us; slowest rank's median; ratio = "
             "DeepEP / warmlink, above 1: warmlink faster)",
             f"{'call':<14}{'budget':<13}{'rounds':>7}{'events: DeepEP':>16}{'warmlink':>10}{'ratio':>7}"
             f"{'host: DeepEP':>14}{'warmlink':>10}{'ratio':>7}"]
    beside = summary["deepep_v1"] = {}
    for budget in BUDGETS:
        rounds = ranks[0]["deep_ep_s"][budget]["rounds"]
        for op in CALLS:
            cells, entry = [], {}
            for clock in ("events", "host"):
                theirs = worst(lambda r, b=budget, o=op, c=clock: r["deepep_v1_s"][b][o][c])
                ours = worst(lambda r, b=budget, o=op, c=clock: r["deep_ep_s"][b][o][c])
                entry[clock] = {"deepep_us": theirs * 1e6, "warmlink_us": ours * 1e6, "ratio": theirs / ours}
                cells.append(f"{theirs * 1e6:>{16 if clock == 'events' else 14}.0f}{ours * 1e6:>10.0f}{theirs / ours:>6.2f}x")
            beside[f"{op}/{budget}"] = {"rounds": rounds, **entry}
            lines.append(f"{op:<14}{BUDGET_NAMES[budget].split()[0]:<13}{rounds:>7}" + "".join(cells))
    return lines
