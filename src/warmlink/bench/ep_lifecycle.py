"""``warmlink bench ep --lifecycles N``: ep Buffers created and destroyed again and again (seed 002).

An MoE job that builds its communication buffer per phase or per test pays for the buffer every
time: a region of ~0.7 GB per rank, its IPC export, every peer opening it, events,
streams. Here every rank process runs N lifecycles (Buffer create, first dispatch, first combine,
close), once with the pool on and once with ``WARMLINK_POOL=0`` (``pool.set_enabled(False)``, in
fresh processes), and reports per-phase medians, what each lifecycle created, and the ratio.

Phases are host-clock seconds on each rank, each ending with a device synchronization; the
table takes the slowest rank's median (lifecycles 2.. with the pool on, all with it off).
"""

from __future__ import annotations

import statistics
import time

from warmlink.bench._proc import Group

__all__ = ["lifecycle_table", "run_ep_lifecycles"]

PHASES = ("create_s", "dispatch_s", "combine_s", "close_s")


def _rank_main(control, results, rank: int, num_ranks: int, store_address: str, secret: str, cfg: dict) -> None:
    import torch

    from warmlink import pool
    from warmlink.bench._ep_routing import routing
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    pool.set_enabled(cfg["pool_on"])
    cuda = cfg["cuda"]
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    x, topk_idx, weights = routing(rank, cfg["tokens"], cfg["experts"], cfg["topk"], cfg["hidden"], device)
    store = Store.connect(store_address, prefix="bench-ep-life", timeout_s=cfg["timeout"], secret=secret)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    rows = []
    for _ in range(cfg["lifecycles"]):
        before = {k: v["created"] for k, v in pool.stats().items()}
        t0 = time.perf_counter()
        buf = Buffer(store, rank, num_ranks, max_tokens_per_rank=cfg["max_tokens"], hidden=cfg["hidden"],
                     num_topk=cfg["topk"], device=rank if cuda else -1, backend="cuda_ipc" if cuda else "shm",
                     timeout_s=cfg["timeout"])
        sync()
        t1 = time.perf_counter()
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=cfg["experts"])
        sync()
        t2 = time.perf_counter()
        buf.combine(recv_x, handle, topk_weights=recv_w)
        sync()
        t3 = time.perf_counter()
        buf.close()
        sync()
        t4 = time.perf_counter()
        after = {k: v["created"] for k, v in pool.stats().items()}
        rows.append({"create_s": t1 - t0, "dispatch_s": t2 - t1, "combine_s": t3 - t2, "close_s": t4 - t3,
                     "created": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}})
    store.close()
    results.put({"event": "result", "tag": f"rank{rank}", "value": rows})


def run_ep_lifecycles(cfg: dict, pool_on: bool) -> list[list[dict]]:
    """Every rank's lifecycle rows, one fresh process per rank, pool on or off."""
    from warmlink.rendezvous import Store

    cfg = dict(cfg, pool_on=pool_on)
    with Store(is_server=True, prefix="bench-ep-life", timeout_s=cfg["timeout"]) as server, Group(cfg["timeout"]) as group:
        for r in range(cfg["ranks"]):
            group.start(f"rank{r}", _rank_main, rank=r, num_ranks=cfg["ranks"], store_address=server.address,
                        secret=server.secret, cfg=cfg)
        msgs = group.expect("result", cfg["ranks"])
    return [m["value"] for m in sorted(msgs, key=lambda m: m["tag"])]


def _summary(ranks: list[list[dict]], skip_first: bool) -> dict:
    out = {}
    for phase in (*PHASES, "total_s"):
        def value(row, phase=phase):
            return sum(row[p] for p in PHASES) if phase == "total_s" else row[phase]

        out[phase] = max(statistics.median(value(r) for r in (rows[1:] if skip_first and len(rows) > 1 else rows))
                         for rows in ranks)
    kinds = sorted({k for rows in ranks for r in rows[1 if skip_first else 0:] for k in r["created"]})
    out["created"] = {k: statistics.median(r["created"].get(k, 0) for rows in ranks for r in rows[1 if skip_first else 0:])
                      for k in kinds}
    out["first_total_s"] = max(sum(rows[0][p] for p in PHASES) for rows in ranks)
    return out


def lifecycle_table(on: list[list[dict]], off: list[list[dict]]) -> tuple[list[str], dict]:
    son, soff = _summary(on, True), _summary(off, False)
    lines = [f"{'per lifecycle (ms, slowest rank median)':<40}{'pool on':>10}{'pool off':>10}{'off / on':>10}"]
    for phase in (*PHASES, "total_s"):
        name = phase.removesuffix("_s").replace("create", "Buffer create").replace("dispatch", "first dispatch") \
            .replace("combine", "first combine").replace("close", "close")
        lines.append(f"{name:<40}{son[phase] * 1e3:>10.2f}{soff[phase] * 1e3:>10.2f}{soff[phase] / son[phase]:>9.1f}x")
    lines.append(f"{'first lifecycle in the process':<40}{son['first_total_s'] * 1e3:>10.2f}")
    fmt = lambda c: ", ".join(f"{k} {v:g}" for k, v in c.items() if v) or "nothing"
    lines.append(f"created per lifecycle: pool on: {fmt(son['created'])}; pool off: {fmt(soff['created'])}")
    return lines, {"pool_on": son, "pool_off": soff, "ratio": soff["total_s"] / son["total_s"]}
