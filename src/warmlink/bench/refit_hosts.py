"""Refit across emulated hosts: one trainer into N engine replicas, time against N, per mode.

``run_hosts_refit`` makes a ``bench.cluster.Cluster`` of ``num_hosts`` hosts whose links are
limited to one rate, starts the trainer on host 0 and the engines on hosts 1.., and times warm
refit cycles for every engine count, once per mode (Note [Refit modes] in
``bench.refit_hosts_roles``). Bytes move over NIXL with UCX on TCP between the hosts' links.

For each mode, one trainer and the engines serve every count: the engines of count N are the first
N, so each count adds engines to a running job, and its first cycle is the newcomers' first
refit (the engines start together, before the first count, and wait idle until they join). Engines fill hosts in blocks of ``ceil(max N / (hosts - 1))`` (Note [Refit modes]).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from typing import Callable

from warmlink.bench._proc import SAFE_ENV
from warmlink.bench.cluster import DEVICE, Cluster
from warmlink.bench.refit_hosts_roles import trainer_copies

__all__ = ["run_hosts_refit", "engine_hosts"]

_ROLES = "warmlink.bench.refit_hosts_roles"
# UCX between hosts: TCP on each host's link (the emulated NIC); the secret only on stdin.
_ENV = {**SAFE_ENV, "UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE, "WARMLINK_SECRET": None}


def engine_hosts(num_hosts: int, max_engines: int) -> list[int]:
    """The host of each engine: blocks of ``ceil(max_engines / (num_hosts - 1))`` on hosts 1.."""
    per_host = -(-max_engines // (num_hosts - 1))
    return [1 + i // per_host for i in range(max_engines)]


def run_hosts_refit(
    spec,
    *,
    num_hosts: int,
    engine_counts: list[int],
    link_rate_bps: int,
    link_queue: str = "small-first",
    modes: tuple[str, ...] = ("pull",),
    cycles: int = 3,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Time refit cycles from a trainer on host 0 into each count of engines, for each mode.

    Args:
        spec: the model (a ``bench.model_spec.ModelSpec``), bf16 in host memory.
        num_hosts: hosts of the emulated cluster, >= 2 (host 0: the trainer).
        engine_counts: engine counts to time, ascending.
        link_rate_bps: every host's link rate, bits per second, each way.
        link_queue: how the links queue (``Cluster``'s, Note [Link queues] in ``bench.cluster``).
        modes: from ``refit_hosts_roles.MODES``.
        cycles: cycles per count; the first is the newcomers' first refit, the rest are warm.
        timeout_s: how long any one step may take, seconds.
        progress: hears one line per step.

    Returns:
        ``{"modes": {mode: [one row per count]}, "placement": [host of each engine], ...}``; a row
        holds its cycles (span from the first engine's start to the last one's end, seconds; bytes
        the trainer's link sent, headers included), ``warm_s`` (the median span of cycles 2..),
        ``bound_s`` (the trainer's copies x bytes / rate), ``unlimited_s`` (one more cycle with
        the links' limit lifted: Note [Link-bound]) and whether every engine held every version
        bit-exact.

    Raises:
        ClusterUnavailable: this machine cannot make the cluster (the message says why).
        RuntimeError: a process failed, died or stalled past ``timeout_s`` (its stderr quoted).
    """
    tell = progress or (lambda line: None)
    placement = engine_hosts(num_hosts, max(engine_counts))
    record = {"nbytes": spec.nbytes, "num_hosts": num_hosts, "link_rate_bps": link_rate_bps,
              "link_queue": link_queue, "cycles": cycles,
              "placement": placement, "modes": {}}
    t = time.perf_counter()
    with Cluster(num_hosts, link_rate_bps=link_rate_bps, link_queue=link_queue, timeout_s=min(timeout_s, 60.0)) as cluster:
        tell(f"cluster: {num_hosts} hosts up in {time.perf_counter() - t:.2f} s")
        for mode in modes:
            record["modes"][mode] = _run_mode(cluster, spec, mode, engine_counts, placement, cycles=cycles, seed=seed,
                                              timeout_s=timeout_s, tell=lambda line, m=mode: tell(f"[{m}] {line}"))
    return record


def _run_mode(cluster: Cluster, spec, mode: str, counts: list[int], placement: list[int], *, cycles: int, seed: int,
              timeout_s: float, tell: Callable[[str], None]) -> list[dict]:
    config = {"spec": dict(spec.__dict__), "seed": seed, "timeout_s": timeout_s, "mode": mode,
              "prefix": f"hosts-{mode}-{uuid.uuid4().hex[:8]}"}
    started = []
    try:
        t = time.perf_counter()
        trainer = cluster.start(0, [sys.executable, "-m", _ROLES, "trainer"], env=_ENV, name=f"{mode} trainer (host 0)")
        started.append(trainer)
        trainer.send(json.dumps({**config, "host": cluster.hosts[0].address}))
        ready = trainer.expect("ready", timeout_s)
        tell(f"trainer ready on host 0 in {time.perf_counter() - t:.1f} s")
        config.update(address=ready["address"], secret=ready["secret"])
        t = time.perf_counter()
        engines = []
        for i, host in enumerate(placement):  # all at once: their imports overlap
            engines.append(cluster.start(host, [sys.executable, "-m", _ROLES, "engine"], env=_ENV,
                                         name=f"{mode} engine {i} (host {host})"))
            started.append(engines[-1])
            engines[-1].send(json.dumps(config))
        for e in engines:
            e.expect("ready", timeout_s)
        tell(f"{len(engines)} engines ready on hosts {', '.join(map(str, sorted(set(placement))))} in "
             f"{time.perf_counter() - t:.1f} s")
        rows = []
        for i, n in enumerate(counts):
            joined = counts[i - 1] if i else 0  # engines[joined:n] take their first version in this count
            rows.append(_time_count(cluster, trainer, engines[:n], joined, mode, spec.nbytes, cycles, timeout_s, tell))
        return rows
    except BaseException:
        for child in started:  # the cluster's teardown ends them too; this stops them now
            child.kill()
        raise
    finally:
        for child in started:
            child.close(timeout_s=30)


def _time_count(cluster: Cluster, trainer, engines: list, joined: int, mode: str, nbytes: int, cycles: int,
                timeout_s: float, tell: Callable[[str], None]) -> dict:
    """``cycles`` refits of fresh versions into ``engines`` (``engines[joined:]`` new to the job),
    then one more with the links' limit lifted (what the CPU and the software allow: Note
    [Link-bound]); one row (see ``run_hosts_refit``)."""
    n, rows = len(engines), []
    for c in range(1, cycles + 1):
        rows.append(_cycle(cluster, trainer, engines, c, timeout_s, joined if c == 1 else n))
        tell(f"N={n} cycle {c}/{cycles}: {rows[-1]['span_s']:.2f} s, trainer sent "
             f"{rows[-1]['trainer_sent_bytes'] / nbytes:.2f} x the model{', WRONG BYTES' if rows[-1]['bad'] else ''}")
    rate = cluster.link_rate_bps
    cluster.set_link_rate(None)
    try:
        free = _cycle(cluster, trainer, engines, cycles + 1, timeout_s)
    finally:
        cluster.set_link_rate(rate)
    tell(f"N={n} unlimited links: {free['span_s']:.2f} s{', WRONG BYTES' if free['bad'] else ''}")
    warm = rows[1:] or rows
    return {"engines": n, "cycles": rows, "warm_s": statistics.median(r["span_s"] for r in warm),
            "bound_s": trainer_copies(mode, n) * nbytes * 8 / rate, "unlimited": free, "unlimited_s": free["span_s"],
            "trainer_sent_x": statistics.median(r["trainer_sent_bytes"] for r in warm) / nbytes,
            "exact": not any(r["bad"] for r in [*rows, free])}


def _cycle(cluster: Cluster, trainer, engines: list, c: int, timeout_s: float, joined: int | None = None) -> dict:
    """One version published and refit into every engine, then checked; its row. The engines
    before ``joined`` refit at once; those from it on are new to the job and take their first
    version one after another, in engine order, while the others refit (Note [Refit modes]: the
    order replicas join is the order of a fan-out chain)."""
    trainer.send("publish")
    version = trainer.expect("published", timeout_s)["version"]
    joined = len(engines) if joined is None else joined
    sent_before = cluster.link_bytes(0)[0]
    for e in engines[:joined]:
        e.send(f"refit {version}")
    newcomers = []
    for e in engines[joined:]:
        e.send(f"refit {version}")
        newcomers.append(e.expect("cycle", timeout_s))
    done = [e.expect("cycle", timeout_s) for e in engines[:joined]] + newcomers
    sent = cluster.link_bytes(0)[0] - sent_before
    for e in engines:
        e.send(f"verify {version}")
    bad = [b for e in engines for b in e.expect("verified", timeout_s)["bad"]]
    slowest = max((m["report"] for m in done), key=lambda r: r["total_s"])
    return {"cycle": c, "version": version, "span_s": max(m["t1"] for m in done) - min(m["t0"] for m in done),
            "trainer_sent_bytes": sent, "created": sum(sum(m["report"]["created"].values()) for m in done),
            "slowest": {k: slowest[k] for k in ("sync_s", "plan_s", "pull_s", "install_s", "total_s")}, "bad": bad[:5]}
