"""``warmlink bench reconfigure``: one receiver process replaced by a new one (seed 001).

A publisher process serves for the whole run (the peer that stays). Each repeat has three stages:

* ``init``: a fresh receiver process starts and completes its first refit;
* ``reconfigure``: that process is killed (SIGKILL: a replaced or failed inference rank does not
  clean up) and a new process starts and completes its first refit;
* ``destroy``: the receiver closes and its process exits.

The new process's phases are reported apart: process start + imports, CUDA context (``torch.empty(1,
device=d)`` first thing, before any warmlink object), model allocation, store connection, engine
creation, then the first refit's own phases. The publisher reports what the change cost it: CPU
seconds and pool creations between the kill and the new receiver's first refit, then one version
bump (``begin_update`` + ``publish``). Pool on and ``WARMLINK_POOL=0`` (``set_enabled(False)`` in
every process) run in one invocation, beside the same change done with a new NCCL group (gloo on
CPU): a persistent trainer process and a new process create a group on a fresh store prefix and
broadcast the same tensors (see ``warmlink.bench.reconfigure_nccl``).

Stage totals use ``time.monotonic`` (CLOCK_MONOTONIC, one clock for every process of a host):
from the parent's spawn or kill to the child's stamp when its first transfer completed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from warmlink.bench import args as bench_args
from warmlink.bench._children import joined, new_process, retire, wrong_tensors
from warmlink.bench._proc import Group
from warmlink.bench.lifecycle import created_delta, make_tensors, tensor_shape

__all__ = ["METHODS", "add_arguments", "memory_need", "run", "run_reconfigure", "tables",
           "warmlink_repeat"]

METHODS = ("warm", "cold", "nccl")
_TITLES = {"warm": "warmlink pool on", "cold": "warmlink pool off", "nccl": "new NCCL group"}


def memory_need(nbytes: int, tensor_nbytes: int, methods: tuple[str, ...], devices: tuple[int, int], install: str):
    """Peak memory of ``run_reconfigure`` (a ``bench._memory.Need``): every method's staying
    process holds the model from the start (a warmlink one staged into /dev/shm on the CPU); one
    receiver at a time holds its model, receive buffers (two sets with ``install="swap"``) and,
    in the last repeat, the expectation. A killed receiver's files are reaped by the next one
    before it allocates, and its device memory is freed before the next one starts."""
    from warmlink.bench._memory import Need

    stayers = [m for m in methods if m in METHODS]
    warmlink = sum(m != "nccl" for m in stayers)
    buffers = nbytes * (2 if install == "swap" else 1) if warmlink else nbytes
    need = Need()
    need.on(devices[0], len(stayers) * (nbytes + 3 * tensor_nbytes))
    need.on(devices[1], 2 * nbytes + 3 * tensor_nbytes)
    if devices[0] < 0:
        need.shm_bytes += warmlink * nbytes
    if devices[1] < 0:
        need.shm_bytes += buffers if warmlink else 0
    else:
        need.on(devices[1], buffers)
    need.host_bytes += need.shm_bytes
    need.processes([devices[0]] * len(stayers) + [devices[1]])
    return need


# ------------------------------------------------------------------------------ warmlink children
def _publisher(*, control, results, address, secret, prefix, num_tensors, tensor_mib, device_idx, pool_on, backend, seed, timeout_s):
    from warmlink import pool
    from warmlink.bench._devices import device_of
    from warmlink.refit import Publisher
    from warmlink.rendezvous import Store

    pool.set_enabled(pool_on)
    device = device_of(device_idx)
    tensors = make_tensors(num_tensors, tensor_mib, device, seed)
    with Store.connect(address, prefix=prefix, timeout_s=timeout_s, secret=secret) as store, \
            Publisher(store, rank=0, world_size=1, backend=backend, timeout_s=timeout_s) as pub:
        for name, t in tensors.items():
            pub.add(name, t)
        pub.export()
        results.put({"tag": prefix, "event": "ready"})
        mark = (pool.stats(), time.process_time())
        while (msg := control.get(timeout=timeout_s)) is not None:
            if msg[0] == "mark":
                mark = (pool.stats(), time.process_time())
                results.put({"tag": prefix, "event": "marked"})
            elif msg[0] == "update":
                cpu_s, created = time.process_time() - mark[1], created_delta(mark[0], pool.stats())
                t0 = time.perf_counter()
                wait_s = pub.begin_update()  # values stay: the benchmark measures the change, not training
                version = pub.publish()
                results.put({"tag": prefix, "event": "updated", "cpu_s": cpu_s, "created": created, "wait_s": wait_s,
                             "update_s": time.perf_counter() - t0, "version": version})


def _receiver(*, control, results, me, address, secret, prefix, num_tensors, tensor_mib, device_idx, pool_on, backend, install,
              seed, timeout_s, verify):
    device, ph = new_process(device_idx)
    import torch

    from warmlink import pool
    from warmlink.refit import Receiver
    from warmlink.refit.manifest import TensorLayout
    from warmlink.rendezvous import Store

    pool.set_enabled(pool_on)
    t0 = time.perf_counter()
    shape = tensor_shape(tensor_mib)
    model = {f"w{i:03d}": torch.zeros(shape, dtype=torch.bfloat16, device=device) for i in range(num_tensors)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    store = Store.connect(address, prefix=prefix, timeout_s=timeout_s, secret=secret)
    t2 = time.perf_counter()
    rec = Receiver(store, num_publishers=1, backend=backend, install=install, timeout_s=timeout_s)
    for name, t in model.items():
        rec.add(name, TensorLayout.plain(name, "bfloat16", shape), t)
    t3 = time.perf_counter()
    report = rec.refit().as_dict()
    t_ready = time.monotonic()
    got = rec.tensors() if install == "swap" else model
    num_bad = wrong_tensors(got, num_tensors, tensor_mib, device, seed) if verify else 0
    results.put({"tag": me, "event": "ready", **ph, "model_s": t1 - t0, "store_s": t2 - t1, "create_s": t3 - t2,
                 "report": report, "t_ready": t_ready, "verified": verify, "num_bad": num_bad,
                 "created": {k: v["created"] for k, v in pool.stats().items()}})
    if control.get(timeout=timeout_s) is None:
        return
    t0 = time.perf_counter()
    rec.close()
    store.close()
    results.put({"tag": me, "event": "left", "close_s": time.perf_counter() - t0})


# -------------------------------------------------------------------------------- orchestration
def warmlink_repeat(group: Group, stayer: str, r: int, *, method: str, last: bool, common: dict, timeout_s: float) -> dict:
    """One repeat's stages for ``"warm"``/``"cold"``; the publisher ``stayer`` is already running.

    Returns:
        ``{"init", "reconfigure", "destroy", "cycle_s", "correct"}`` (seconds; ``correct`` is True
        unless ``last`` and a receiver got wrong bytes).
    """
    correct = True

    def spawn(tag: str) -> tuple[float, dict]:
        t = time.monotonic()
        group.start(tag, _receiver, me=tag, prefix=stayer, pool_on=method == "warm", verify=last, **common)
        return t, group.expect("ready", 1)[0]

    a, b = f"{method}{r}a", f"{method}{r}b"
    t, msg = spawn(a)
    init = joined(t, msg)
    correct &= msg["num_bad"] == 0
    group.send(stayer, ("mark",))
    group.expect("marked", 1)
    t_kill = time.monotonic()
    retire(group, a, kill=True, timeout_s=timeout_s)
    t, msg = spawn(b)
    reconf = {"exit_s": t - t_kill, **joined(t, msg)}
    reconf["total_s"] = msg["t_ready"] - t_kill
    correct &= msg["num_bad"] == 0
    group.send(stayer, ("update",))
    upd = group.expect("updated", 1)[0]
    # busy_s: the change needs no call from the publisher (receivers pull; it stays blocked on its
    # queue), so none is timed; cpu_s is its whole process's CPU over the change (driver threads too).
    reconf["stayer"] = {"busy_s": 0.0, "cpu_s": upd["cpu_s"], "created": upd["created"], "update_s": upd["update_s"],
                        "wait_s": upd["wait_s"]}
    t = time.monotonic()
    group.send(b, ("close",))
    close_s = group.expect("left", 1)[0]["close_s"]
    retire(group, b, kill=False, timeout_s=timeout_s)
    destroy = {"close_s": close_s, "total_s": time.monotonic() - t}
    destroy["exit_s"] = destroy["total_s"] - close_s
    return {"init": init, "reconfigure": reconf, "destroy": destroy,
            "cycle_s": init["total_s"] + reconf["total_s"] + destroy["total_s"], "correct": correct}


def run_reconfigure(
    *,
    repeats: int = 10,
    num_tensors: int = 16,
    tensor_mib: float = 64.0,
    methods: tuple[str, ...] = METHODS,
    devices: tuple[int, int] = (0, 1),
    backend: str | None = None,
    install: str = "copy",
    seed: int = 0,
    timeout_s: float = 300.0,
    progress=None,
) -> dict:
    """Run ``repeats`` init / reconfigure / destroy stages for each of ``methods``.

    Args:
        repeats: repeats per method, >= 1.
        num_tensors, tensor_mib: the model: bf16 tensors of about ``tensor_mib`` MiB each.
        methods: some of ``"warm"`` (pool on), ``"cold"`` (pool off), ``"nccl"`` (new NCCL group:
            two distinct GPUs, or gloo on CPU).
        devices: the staying process's and the receivers' CUDA devices; -1 = CPU (shm, gloo).
        backend, install: the warmlink transport (default auto) and receiver install mode.
        timeout_s: seconds any wait may take before the run fails.
        progress: optional callable taking ``(method, finished repeats)``.

    Returns:
        A JSON-able dict ``{method: {"repeats": [{"init": phases, "reconfigure": phases + "exit_s" +
        "stayer", "destroy": {"close_s", "exit_s", "total_s"}, "cycle_s"}], "correct": bool}}``,
        seconds throughout; bytes are verified in the last repeat's receivers.

    Raises:
        RuntimeError: a child failed, died or stalled past ``timeout_s`` (children are stopped).
    """
    from warmlink.bench.reconfigure_nccl import nccl_repeat, nccl_trainer
    from warmlink.rendezvous import Store

    uid = time.monotonic_ns()
    out: dict = {}
    with Store("127.0.0.1", 0, is_server=True, prefix=f"bench-reconf-{uid}", timeout_s=timeout_s) as store, \
            Group(timeout_s) as group:
        common = {"address": store.address, "secret": store.secret, "num_tensors": num_tensors, "tensor_mib": tensor_mib, "backend": backend,
                  "seed": seed, "timeout_s": timeout_s}
        stayers = {}
        for m in methods:  # every staying process starts at once; they idle while the others run
            stayers[m] = f"bench-reconf-{uid}-{m}"
            if m == "nccl":
                group.start(stayers[m], nccl_trainer, me=stayers[m], host=store.host, port=store.port,
                            backend="gloo" if devices[0] < 0 else "nccl", device_idx=devices[0],
                            **{k: v for k, v in common.items() if k not in ("address", "secret", "backend")})
            else:
                group.start(stayers[m], _publisher, prefix=stayers[m], device_idx=devices[0], pool_on=m == "warm", **common)
        group.expect("ready", len(methods))
        for m in methods:
            res = {"repeats": [], "correct": True}
            for r in range(repeats):
                if m == "nccl":
                    one = nccl_repeat(group, stayers[m], r, last=r == repeats - 1, host=store.host, port=store.port,
                                      device_idx=devices[1], common=common, timeout_s=timeout_s)
                else:
                    one = warmlink_repeat(group, stayers[m], r, method=m, last=r == repeats - 1, timeout_s=timeout_s,
                                          common=dict(common, device_idx=devices[1], install=install))
                res["correct"] &= one.pop("correct")
                res["repeats"].append(one)
                if progress is not None:
                    progress(m, r + 1)
            out[m] = res
    return out


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=10, help="init/reconfigure/destroy repeats per method (default 10)")
    p.add_argument("--tensors", type=int, default=16, help="tensors in the model (default 16)")
    p.add_argument("--tensor-mib", type=float, default=64.0, help="MiB per bf16 tensor (default 64: 1 GiB in all)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)} (default: all)")
    p.add_argument("--devices", type=bench_args.devices, default=None,
                   help="publisher,receiver CUDA devices, -1,-1 = CPU: shm, gloo (default: 0,1 on two or more GPUs, 0,0 on "
                        "one, -1,-1 without)")
    p.add_argument("--install", choices=("copy", "swap"), default="copy", help="receiver install mode (default copy)")
    p.add_argument("--json", dest="json_path", default=None, help="write the JSON record here")
    p.add_argument("--plot", default=None, help="write a PNG chart (reconfigure phases per repeat, stacked) here")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the tensor values every method sends and checks (default 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any process may stall (default 300)")


# (row label, stage, key); a key a method lacks shows "-".
_ROWS = (
    ("old process exit", "reconfigure", "exit_s"), ("process start + imports", "reconfigure", "start_imports_s"),
    ("CUDA context", "reconfigure", "cuda_s"), ("model alloc", "reconfigure", "model_s"),
    ("store connect", "reconfigure", "store_s"), ("engine create + add", "reconfigure", "create_s"),
    ("connect / init_process_group", "reconfigure", "connect_s"), ("first refit: sync", "reconfigure", "sync_s"),
    ("  plan", "reconfigure", "plan_s"), ("  alloc", "reconfigure", "alloc_s"), ("  register", "reconfigure", "register_s"),
    ("first collective (communicator)", "reconfigure", "first_collective_s"),
    ("pull / tensors broadcast", "reconfigure", "pull_s"), ("translate + install", "reconfigure", "translate_install_s"),
    ("library total (connect .. install)", "reconfigure", "refit_s"), ("reconfigure total", "reconfigure", "total_s"),
)


def _p50(res: dict, stage: str, key: str):
    vals = [(rep[stage] if stage else rep).get(key) for rep in res["repeats"]]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def tables(record: dict) -> tuple[list[dict], list[dict], list[str]]:
    """``(reconfigure phase rows, stage rows, columns)`` of P50s in seconds for ``cycle_table``."""
    from warmlink.bench.report import ratio

    methods = [m for m in METHODS if m in record["methods"]]
    cols = ["phase"] + [f"{_TITLES[m]}_s" for m in methods] + (["NCCL / pool on"] if {"warm", "nccl"} <= set(methods) else [])

    def row(label: str, values: dict) -> dict:
        r = {"phase": label, **{f"{_TITLES[m]}_s": values.get(m) for m in methods}}
        if len(cols) > len(methods) + 1 and isinstance(values.get("nccl"), float) and (values.get("warm") or 0) > 0:
            r["NCCL / pool on"] = ratio(values["nccl"], values["warm"])
        return r

    res = record["methods"]
    phases = [row(label, {m: _p50(res[m], st, k) for m in methods}) for label, st, k in _ROWS]
    for label, key in (("peer that stays: wall time in calls the change needs", "busy_s"),
                       ("peer that stays: process CPU during the change", "cpu_s"),
                       ("peer that stays: next version (begin_update + publish)", "update_s")):
        stayers = {m: {"repeats": [r["reconfigure"]["stayer"] for r in res[m]["repeats"]]} for m in methods}
        phases.append(row(label, {m: _p50(stayers[m], "", key) for m in methods}))
    created = {}
    for m in methods:
        c = res[m]["repeats"][-1]["reconfigure"]["stayer"].get("created")
        created[m] = "group" if c is None else (", ".join(f"{k} {v}" for k, v in c.items() if v) or "0")
    phases.append({"phase": "peer that stays: created", **{f"{_TITLES[m]}_s": created[m] for m in methods}})
    stages = [row(label, {m: _p50(res[m], st, "total_s") for m in methods})
              for label, st in (("init", "init"), ("reconfigure", "reconfigure"), ("destroy", "destroy"))]
    stages.append(row("whole cycle (init + reconfigure + destroy)", {m: _p50(res[m], "", "cycle_s") for m in methods}))
    return phases, stages, cols


def run(args: argparse.Namespace) -> int:
    """The ``warmlink bench reconfigure`` command: prints progress and the two P50 tables."""
    from warmlink.bench._memory import shortfall
    from warmlink.bench._devices import pick_devices
    from warmlink.bench.report import cycle_table, machine_info, write_record

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if set(methods) - set(METHODS) or not methods:
        print(f"warmlink bench reconfigure: --methods={args.methods!r}; expected some of {list(METHODS)}", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.tensors < 1 or not args.tensor_mib > 0:
        print("warmlink bench reconfigure: --repeats, --tensors and --tensor-mib must be positive", file=sys.stderr)
        return 2
    if args.devices is not None and (problem := bench_args.check_devices(args.devices)):
        return bench_args.refuse("warmlink bench reconfigure", problem)
    devices = pick_devices(args.devices)
    if "nccl" in methods and devices[0] >= 0 and devices[0] == devices[1]:
        print("  skipping nccl: NCCL cannot place two ranks on one GPU")
        methods = tuple(m for m in methods if m != "nccl")
    rows, cols = tensor_shape(args.tensor_mib)
    nbytes = args.tensors * rows * cols * 2
    short = shortfall(memory_need(nbytes, rows * cols * 2, methods, devices, args.install),
                      "lower --tensors or --tensor-mib, or free memory")
    if short:
        return bench_args.refuse("warmlink bench reconfigure", short)
    where = "CPU (shm, gloo)" if devices[0] < 0 else f"cuda:{devices[0]} -> cuda:{devices[1]}"
    print(f"warmlink bench reconfigure: {args.repeats} repeats of init / reconfigure / destroy, {args.tensors} bf16 "
          f"tensors, {nbytes / 2**20:.2f} MiB, {where}, methods {','.join(methods)}")
    t = time.perf_counter()

    def progress(method: str, done: int) -> None:
        print(f"  {_TITLES[method]}: {done}/{args.repeats} ({time.perf_counter() - t:.1f} s)", flush=True)

    res = run_reconfigure(repeats=args.repeats, num_tensors=args.tensors, tensor_mib=args.tensor_mib, methods=methods,
                          devices=devices, install=args.install, seed=args.seed, timeout_s=args.timeout, progress=progress)
    record = {"bench": "reconfigure", "repeats": args.repeats, "num_tensors": args.tensors, "tensor_shape": [rows, cols],
              "nbytes": nbytes, "devices": list(devices), "install": args.install, "methods": res, "machine": machine_info()}
    phases, stages, columns = tables(record)
    record["summary"] = {"reconfigure_phases_p50": phases, "stages_p50": stages}
    print()
    print(cycle_table(phases, columns, title="reconfigure: one receiver process replaced -> the new one's first transfer "
                                             "(P50 ms)"))
    print()
    print(cycle_table(stages, columns, title="stages (P50 ms, parent clock)"))
    ok = all(r["correct"] for r in res.values())
    if not ok:
        print("INCORRECT BYTES in " + ", ".join(m for m, r in res.items() if not r["correct"]))
    if args.json_path:
        write_record(args.json_path, record)
        print(f"record: {args.json_path}")
    if args.plot:
        from warmlink.bench.report import plot_cycles

        keys = [k for _l, st, k in _ROWS if k not in ("total_s", "refit_s")]
        plot = {m: {"cycles": [{"cycle": i + 1, **{k: rep["reconfigure"].get(k) or 0.0 for k in keys},
                                "total_s": rep["reconfigure"]["total_s"]} for i, rep in enumerate(r["repeats"])]}
                for m, r in res.items()}
        plot_cycles({"title": "reconfigure: a receiver process replaced", "methods": plot}, args.plot, stacked=True)
        print(f"chart: {args.plot}")
    return 0 if ok else 1
