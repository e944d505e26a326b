"""``warmlink bench refit``: every refit method side by side in one run.

Scenarios (each in fresh processes, same tensors, same machine, same run):

* ``warm``     warmlink, pool on, matched layout (TP 1 -> 1)
* ``cold``     warmlink, ``WARMLINK_POOL=0``: every cycle allocates, registers, opens and plans
* ``nccl``     NCCL broadcast per tensor, trainer -> inference (what RL frameworks do today)
* ``bucket``   NCCL broadcast of 1 GiB buckets with pack/unpack
* ``tp21``     warmlink, pool on, trainer TP 2 -> inference TP 1 (fused QKV/gate-up re-cut)
* ``tp12``     warmlink, pool on, trainer TP 1 -> inference TP 2
* ``peak``     one large copy-engine peer copy (the ceiling), and 290 copies looped vs batched
* ``ipc``      what colocated frameworks do today (vLLM's ``ipc`` backend, verl): every cycle the
               trainer exports a CUDA IPC handle per tensor, the engine opens each and copies it
               in (``bench.ipc_refit``); GPUs only
* ``nixl``     warmlink over the nixl backend (NIXL + UCX), pool on, TP 1 -> 1
* ``nixl_cold`` the same with ``WARMLINK_POOL=0`` (a NIXL agent made and dropped every cycle)
* ``nixl_rw``  NIXL READ vs WRITE vs WRITE + notification of the same tensors (``bench.nixl_rw``)

``--backend nixl`` adds the three nixl scenarios to the run, beside the default transport's.

``--devices 0,0`` is the colocated mode: trainer and engine share one GPU (hybrid-engine RL), the
copy peak is one flat device-to-device copy of the same bytes, and ``warm`` runs once per install
mode of ``--install`` (default ``direct,swap,copy``; Note [Install modes] in ``refit._install``),
each with the receiver's and the publisher's memory beyond the model.

``--hosts H`` runs on an emulated cluster instead (``bench.refit_hosts_cli``): H hosts as network
namespaces behind rate-limited links, one trainer into ``--engines`` replicas over NIXL/UCX TCP,
the warm cycle time against N for every engine pulling from the trainer (and for fan-out) beside
the bound bytes / link rate. ``--engines N`` alone runs them on this machine's devices
(``bench.refit_engines_cli``).

GB means 10^9 bytes. "% of peak" is (bytes / peak bandwidth) / cycle time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

from warmlink.bench import args as bench_args
from warmlink.bench import refit_hosts_cli
from warmlink.bench._devices import pick_devices

__all__ = ["add_arguments", "run", "SCENARIOS"]

SCENARIOS = ("peak", "warm", "cold", "nccl", "bucket", "tp21", "tp12", "ipc", "nixl", "nixl_cold", "nixl_rw")
INSTALL_MODES = ("direct", "swap", "copy")
_NIXL = ("nixl", "nixl_cold", "nixl_rw")
_COLUMNS = ["cycle", "connect", "sync", "plan", "alloc", "register", "pull", "translate", "install", "total", "created"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=bench_args.fraction, default=None,
                   help="fraction of the 8.8 GB Qwen3-4B shape, in (0, 1] (default 1.0; with --engines on CPU 0.02; "
                        "with --hosts see below)")
    p.add_argument("--cycles", type=bench_args.int_in(1), default=None,
                   help="refit cycles per scenario (default 5; with --hosts 3)")
    p.add_argument("--scenarios", default=None,
                   help=f"comma list from {','.join(SCENARIOS)} (default: all but the nixl ones)")
    p.add_argument("--backend", choices=("auto", "nixl"), default="auto",
                   help="nixl: also run warmlink over NIXL (scenarios nixl, nixl_cold, nixl_rw) beside the default "
                        "transport (cuda_ipc on GPUs, shm on CPU), in the same run (needs warmlink[nixl])")
    p.add_argument("--nixl-threads", type=bench_args.int_in(0, 64), default=None, metavar="N",
                   help="UCX threads per NIXL agent in the nixl scenarios (default: the link's default; "
                        "see NixlLink ucx_threads)")
    p.add_argument("--nixl-sweep", default=None, metavar="LIST",
                   help="nixl_rw also runs once per UCX thread count of this comma list, e.g. 0,2,4,8")
    p.add_argument("--devices", type=bench_args.devices, default=None,
                   help="trainer,inference CUDA devices, -1,-1 = CPU over shm (default: 0,1 on two or more GPUs, 0,0 "
                        "on one (colocated), -1,-1 without)")
    p.add_argument("--install", type=_install_list, default=None, metavar="MODES",
                   help="receiver install modes, comma list of direct,swap,copy: warm runs once per mode, the other "
                        "warmlink scenarios with the first (default: direct,swap,copy on one GPU, swap otherwise); with "
                        "--engines: copy and/or swap, each timed in turn (default copy)")
    p.add_argument("--json", dest="json_path", default=None, help="write the JSON record here")
    p.add_argument("--plot", default=None, help="write a PNG chart here (refused with --engines)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the tensor values that the warmlink and ipc scenarios and --hosts send and check "
                        "(default 0); the NCCL baselines send a fixed pattern, and --engines ignores it (seed 0)")
    p.add_argument("--timeout", type=bench_args.positive_float, default=600.0, help="seconds any process may stall (default 600)")
    refit_hosts_cli.add_arguments(p)


def _install_list(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in INSTALL_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct modes from {','.join(INSTALL_MODES)}")
    return modes


def _skip_reason(name: str, devices: tuple[int, int]) -> str | None:
    if name in ("nccl", "bucket") and devices[0] >= 0 and devices[0] == devices[1]:
        return "NCCL cannot place two ranks on one GPU"
    if name == "ipc" and (devices[0] < 0 or devices[0] != devices[1]):
        return "the per-tensor IPC baseline is the colocated path: trainer and engine on one GPU"
    return None


def _peak(devices: tuple[int, int], nbytes: int) -> dict:
    """The copy ceiling: one large peer copy on GPUs, one large memcpy on the CPU."""
    from warmlink.bench._proc import run_in_child

    if devices[0] < 0:
        return run_in_child(_cpu_memcpy_peak, nbytes=max(64 << 20, min(nbytes, 1 << 30)))
    from warmlink.bench.peak import batched_vs_loop, flat_copy_peak, peer_copy_peak

    if devices[0] == devices[1]:  # colocated: one flat copy of all the bytes, the HBM ceiling
        out = run_in_child(flat_copy_peak, device=devices[0], nbytes=nbytes)
    else:
        out = run_in_child(peer_copy_peak, src_device=devices[0], dst_device=devices[1], nbytes=min(nbytes, 1 << 30))
    out["gbps"] = out["one_way_gbps"]
    out["batched_vs_loop"] = run_in_child(batched_vs_loop, num_tensors=290, total_nbytes=min(nbytes, 8 << 30),
                                          src_device=devices[0], dst_device=devices[1])
    return out


def _cpu_memcpy_peak(nbytes: int, repeats: int = 5) -> dict:
    import torch

    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    b.copy_(a)  # fault the pages in before timing
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return {"kind": "cpu memcpy", "nbytes": nbytes, "gbps": nbytes / statistics.median(times) / 1e9}


def _need(name: str, spec, devices: tuple[int, int], install: str):
    """Peak memory of scenario ``name`` (a ``bench._memory.Need``); scenarios run one at a time."""
    from warmlink.bench._memory import Need
    from warmlink.bench.refit import warmlink_refit_need

    if name in ("warm", "cold", "tp21", "tp12", "nixl", "nixl_cold") or name.startswith("warm_"):
        src_tp, dst_tp = {"tp21": (2, 1), "tp12": (1, 2)}.get(name, (1, 1))
        return warmlink_refit_need(spec, src_tp=src_tp, dst_tp=dst_tp, devices=devices, install=install)
    nbytes, need = spec.nbytes, Need()
    largest = max(layout.nbytes for layout in spec.layouts(1, 0).values())
    if name == "peak":
        copy = max(64 << 20, min(nbytes, 1 << 30)) if devices[0] < 0 else min(nbytes, 8 << 30)
        if devices[0] >= 0 and devices[0] == devices[1]:
            copy = nbytes  # the flat copy's two buffers of all the bytes
        need.on(devices[0], copy)
        need.on(devices[1], copy)
        need.processes([devices[0]] if devices[0] == devices[1] else list(devices))
    else:  # nccl, bucket, nixl_rw: each side holds the tensors (and one 1 GiB bucket)
        extra = (1 << 30) if name == "bucket" else 0
        need.on(devices[0], nbytes + extra + 3 * largest)
        need.on(devices[1], nbytes + extra + 3 * largest)
        need.processes(list(devices))
    return need


def _nccl_rows(res: dict) -> list[dict]:
    rows = []
    for c in res["cycles"]:
        setup = (res["init_s"] + res["first_collective_s"]) if c["cycle"] == 1 else 0.0
        rows.append({
            "cycle": c["cycle"], "connect": setup, "sync": 0.0, "plan": 0.0, "alloc": c["alloc_s"], "register": 0.0,
            "pull": c["transfer_s"], "translate": c["pack_s"] + c["unpack_s"], "install": 0.0,
            "total": c["total_s"] + setup, "created": "group" if c["cycle"] == 1 else 0,
        })
    return rows


def _ipc_rows(res: dict) -> list[dict]:
    """The IPC baseline in the cycle table's columns: export -> register, opening -> alloc."""
    return [{
        "cycle": c["cycle"], "connect": 0.0, "sync": 0.0, "plan": 0.0, "alloc": c["open_s"], "register": c["export_s"],
        "pull": c["copy_s"], "translate": 0.0, "install": 0.0, "total": c["total_s"], "created": "handles",
    } for c in res["cycles"]]


def _warm_rows(res: dict) -> list[dict]:
    return [{
        "cycle": c["cycle"], "connect": c["connect_s"], "sync": c["sync_s"], "plan": c["plan_s"], "alloc": c["alloc_s"], "register": c["register_s"],
        "pull": c["pull_s"], "translate": c["translate_s"], "install": c["install_s"], "total": c["total_s"],
        "created": sum(c["created"].values()),
    } for c in res["cycles"]]


@contextlib.contextmanager
def _nixl_threads_env(threads: int | None):
    """``WARMLINK_NIXL_THREADS`` set for the processes started inside (they inherit it)."""
    if threads is None:
        yield
        return
    before = os.environ.get("WARMLINK_NIXL_THREADS")
    os.environ["WARMLINK_NIXL_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("WARMLINK_NIXL_THREADS", None)
        else:
            os.environ["WARMLINK_NIXL_THREADS"] = before


def _print_nixl(sc: dict, nbytes: int, peak_gbps: float | None, record: dict) -> None:
    """The nixl figures of the run: READ/WRITE and the warm cycle against the default transport's."""
    rw = sc.get("nixl_rw")
    if rw:
        print(f"NIXL on the same {rw['num_descs']} descriptors ({rw['nbytes'] / 1e9:.3f} GB; median of {rw['read']['runs']}; "
              f"UCX threads {rw['ucx_threads']}):")
        for key, label in (("read", "READ (pull)"), ("write", "WRITE (push)"), ("write_notify", "WRITE, target notified")):
            r = rw[key]
            peak = f", {100 * r['gbps'] / peak_gbps:.0f}% of peak" if peak_gbps else ""
            print(f"  {label:24s} {r['median_s'] * 1e3:9.2f} ms  {r['gbps']:7.1f} GB/s{peak}")
        for r in rw.get("sweep", []):
            peak = f" ({100 * r['read']['gbps'] / peak_gbps:.0f}% of peak)" if peak_gbps else ""
            print(f"  UCX threads {r['ucx_threads']:2d}: READ {r['read']['median_s'] * 1e3:8.2f} ms {r['read']['gbps']:6.1f} GB/s"
                  f"{peak}, WRITE {r['write']['median_s'] * 1e3:8.2f} ms {r['write']['gbps']:6.1f} GB/s")
    if "nixl" in sc and "warm" in sc:
        ours, base = sc["nixl"]["summary"]["warm"], sc["warm"]["summary"]["warm"]
        record["nixl_vs_default"] = base / ours
        default = "shm" if record["devices"][0] < 0 else "cuda_ipc"
        print(f"nixl warm cycle {ours * 1e3:.2f} ms vs {default} {base * 1e3:.2f} ms: "
              f"{base / ours:.2f} of its speed (goal >= 0.8)")
    if "nixl" in sc and "nixl_cold" in sc:
        ours, off = sc["nixl"]["summary"]["warm"], sc["nixl_cold"]["summary"]["warm"]
        print(f"nixl pool on vs off (warm cycles): {off / ours:.1f}x")


def run(args: argparse.Namespace) -> int:
    from warmlink.bench._memory import Need, shortfall
    from warmlink.bench.model_spec import qwen3_4b_like
    from warmlink.bench.refit import run_warmlink_refit
    from warmlink.bench.report import cycle_table, gbps, machine_info, write_record

    if args.hosts is not None:
        return refit_hosts_cli.run(args)
    if args.engines is not None:
        from warmlink.bench import refit_engines_cli

        return refit_engines_cli.run(args)
    for flag, value in (("--link-rate", args.link_rate), ("--link-queue", args.link_queue), ("--modes", args.modes),
                        ("--fanout-chunks", args.fanout_chunks)):
        if value is not None:
            return bench_args.refuse("warmlink bench refit", f"{flag} needs --hosts (the emulated cluster)")
    args.scale = args.scale if args.scale is not None else 1.0
    args.cycles = args.cycles if args.cycles is not None else 5
    default = [s for s in SCENARIOS if s not in _NIXL]
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()] if args.scenarios else default
    if args.backend == "nixl":
        wanted += [s for s in _NIXL if s not in wanted]
    unknown = sorted(set(wanted) - set(SCENARIOS))
    if unknown:
        print(f"warmlink bench refit: unknown scenarios {unknown}; expected some of {list(SCENARIOS)}", file=sys.stderr)
        return 2
    try:
        sweep = [int(x) for x in args.nixl_sweep.split(",") if x.strip()] if args.nixl_sweep else []
    except ValueError:
        print(f"warmlink bench refit: --nixl-sweep {args.nixl_sweep!r} is not a comma list of integers", file=sys.stderr)
        return 2
    if sweep and "nixl_rw" not in wanted:
        print("warmlink bench refit: --nixl-sweep needs the nixl_rw scenario (--backend nixl)", file=sys.stderr)
        return 2
    if args.devices is not None and (problem := bench_args.check_devices(args.devices)):
        return bench_args.refuse("warmlink bench refit", problem)
    devices = pick_devices(args.devices)
    colocated = devices[0] >= 0 and devices[0] == devices[1]
    installs = args.install or (INSTALL_MODES if colocated else ("swap",))
    install = installs[0]  # every warmlink scenario's mode; warm also runs with the others
    if "warm" in wanted:
        at = wanted.index("warm") + 1
        wanted[at:at] = [f"warm_{mode}" for mode in installs[1:]]
    spec = qwen3_4b_like(args.scale)
    nbytes = spec.nbytes
    layouts = spec.layouts(1, 0)
    need = Need()
    for name in wanted:
        if not _skip_reason(name, devices):
            need = need.peak(_need(name, spec, devices, name[5:] if name.startswith("warm_") else install))
    short = shortfall(need, "lower --scale, or free memory")
    if short:
        return bench_args.refuse("warmlink bench refit", short)
    where = "CPU over shm" if devices[0] < 0 else f"cuda:{devices[0]} -> cuda:{devices[1]}"
    print(f"warmlink bench refit: {len(layouts)} tensors, {nbytes / 1e9:.3f} GB ({spec.dtype}), {args.cycles} cycles, {where}")
    record = {"bench": "refit", "spec": dict(spec.__dict__), "nbytes": nbytes, "num_tensors": len(layouts), "devices": devices,
              "install": list(installs), "cycles": args.cycles, "nixl_threads": args.nixl_threads, "scenarios": {},
              "machine": machine_info()}
    peak_gbps = None
    tables = []
    memory = []  # (what, receiver bytes beyond its model, publisher bytes beyond its model)

    def step(name: str, fn):
        t = time.perf_counter()
        print(f"  [{len(record['scenarios']) + 1}/{len(wanted)}] {name} ...", end="", flush=True)
        res = fn()
        print(f" {time.perf_counter() - t:.1f} s")
        record["scenarios"][name] = res
        return res

    for name in list(wanted):
        reason = _skip_reason(name, devices)
        if reason:
            print(f"  skipping {name}: {reason}")
            wanted.remove(name)
    for name in wanted:
        if name == "peak":
            res = step(name, lambda: _peak(devices, nbytes))
            peak_gbps = res["gbps"]
        elif name in ("warm", "cold", "tp21", "tp12", "nixl", "nixl_cold") or name.startswith("warm_"):
            src_tp, dst_tp = {"tp21": (2, 1), "tp12": (1, 2)}.get(name, (1, 1))
            cold, backend = name.endswith("cold"), "nixl" if name.startswith("nixl") else None
            mode = name[5:] if name.startswith("warm_") else install
            with _nixl_threads_env(args.nixl_threads if backend else None):
                res = step(name, lambda: run_warmlink_refit(
                    spec, src_tp=src_tp, dst_tp=dst_tp, cycles=args.cycles, pool_on=not cold, devices=devices,
                    backend=backend, install=mode, seed=args.seed, timeout_s=args.timeout, label=name,
                    progress=lambda what: print(f" {what},", end="", flush=True)))
            memory.append((f"warmlink {name}, install {mode}", res["receive_nbytes"], res["staging_nbytes"]))
            tables.append((name, f"warmlink {name}: TP {src_tp} -> {dst_tp}, pool {'off' if cold else 'on'}, "
                                 f"install {mode}{', over NIXL' if backend else ''}"
                                 f"{'' if res['correct'] else '  (INCORRECT BYTES)'}", _warm_rows(res)))
        elif name == "ipc":
            from warmlink.bench.ipc_refit import run_ipc_refit

            res = step(name, lambda: run_ipc_refit(spec, cycles=args.cycles, device=devices[0], seed=args.seed,
                                                   timeout_s=args.timeout))
            tables.append((name, "per-tensor CUDA IPC handles each cycle (vLLM ipc / verl)"
                                 f"{'' if res['correct'] else '  (INCORRECT BYTES)'}", _ipc_rows(res)))
        elif name == "nixl_rw":
            from warmlink.bench.nixl_rw import run_nixl_rw

            sizes = [layout.nbytes for layout in layouts.values()]
            res = step(name, lambda: run_nixl_rw(sizes, devices=devices, repeats=max(3, args.cycles),
                                                 ucx_threads=args.nixl_threads, timeout_s=args.timeout))
            for threads in sweep:
                t = time.perf_counter()
                print(f"        nixl_rw with {threads} UCX threads ...", end="", flush=True)
                res.setdefault("sweep", []).append(run_nixl_rw(
                    sizes, devices=devices, repeats=max(3, args.cycles), ucx_threads=threads, timeout_s=args.timeout))
                print(f" {time.perf_counter() - t:.1f} s")
        else:
            from warmlink.bench.nccl_refit import run_nccl_refit

            tensors = [(n, l.local_shape, l.dtype) for n, l in layouts.items()]
            backend = "gloo" if devices[0] < 0 else "nccl"
            res = step(name, lambda: run_nccl_refit(
                tensors, mode="per_tensor" if name == "nccl" else "bucket", cycles=args.cycles,
                devices=devices, backend=backend, timeout_s=args.timeout))
            res["label"] = f"{backend} {'per tensor' if name == 'nccl' else 'buckets'}"  # the chart's legend
            tables.append((name, f"{backend} broadcast {'per tensor' if name == 'nccl' else 'in 1 GiB buckets'}"
                                 f"{'' if res['correct'] else '  (INCORRECT BYTES)'}", _nccl_rows(res)))

    print()
    for _name, title, rows in tables:
        print(cycle_table(rows, _COLUMNS, title=title + " (ms)"))
        print()
    summary = []
    for name, title, rows in tables:
        warm = statistics.median(r["total"] for r in rows[1:]) if len(rows) > 1 else rows[0]["total"]
        setup = statistics.median(r["connect"] + r["plan"] + r["alloc"] + r["register"] for r in rows[1:]) if len(rows) > 1 else 0.0
        row = {"method": title.split("  (")[0], "cycle 1": rows[0]["total"], "warm": warm, "GB/s": gbps(nbytes, warm),
               "setup share": f"{100 * setup / warm:.2f}%"}
        if peak_gbps:
            row["of peak"] = f"{100 * (nbytes / (peak_gbps * 1e9)) / warm:.1f}%"
        summary.append(row)
        record["scenarios"][name]["summary"] = {k: v for k, v in row.items()}
    if peak_gbps:
        print(f"copy peak (same run): {peak_gbps:.1f} GB/s -> {nbytes / (peak_gbps * 1e9) * 1e3:.2f} ms for these bytes")
    cols = ["method", "cycle 1", "warm", "GB/s", "setup share"] + (["of peak"] if peak_gbps else [])
    print(cycle_table(summary, cols, title="summary (ms; warm = median of cycles >= 2)"))
    if memory:
        print("memory beyond the model, per process (receive buffers; publisher staging):")
        for what, recv, staged in memory:
            print(f"  {what:44s} receiver {recv / 1e9:7.3f} GB   publisher {staged / 1e9:7.3f} GB")
        record["memory"] = [{"what": w, "receive_nbytes": r, "staging_nbytes": s} for w, r, s in memory]
    sc = record["scenarios"]
    _print_nixl(sc, nbytes, peak_gbps, record)
    if "warm" in sc and "nccl" in sc:
        joining = sc["warm"]["cycles"][0]["total_s"]
        ours = sc["warm"]["export_s"] + joining
        theirs = sc["nccl"]["init_s"] + sc["nccl"]["first_collective_s"] + sc["nccl"]["cycles"][0]["total_s"]
        record["first_cycle"] = {"warmlink_s": ours, "nccl_s": theirs, "ratio": ours / theirs,
                                 "joining_s": joining, "joining_ratio": joining / theirs}
        group = "gloo" if devices[0] < 0 else "NCCL"
        print(f"first cycle, setup included (publisher export + receiver cycle 1): {ours * 1e3:.1f} ms = "
              f"{100 * ours / theirs:.1f}% of {group} group creation + first broadcast ({theirs * 1e3:.1f} ms)")
        # An engine joining a running job meets a trainer that exported when it started.
        print(f"an engine joining a running job (receiver cycle 1, connect included): {joining * 1e3:.1f} ms = "
              f"{100 * joining / theirs:.1f}% of the same")
    ok = all(record["scenarios"][n].get("correct", True) for n in record["scenarios"])
    if args.json_path:
        write_record(args.json_path, record)
        print(f"record: {args.json_path}")
    if args.plot:
        from warmlink.bench.report import plot_cycles

        plot_cycles(record, args.plot)
        print(f"chart: {args.plot}")
    return 0 if ok else 1
