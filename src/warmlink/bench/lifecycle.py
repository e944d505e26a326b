"""``warmlink bench lifecycle``: engines created and destroyed again and again (seed 002).

A test suite that builds a client per test creates and destroys the engine thousands of times;
seed 002 found ~919 ms of stream creation and destruction per test. Here two persistent
processes, a "trainer" and an "inference" process (spawned once per mode, like a test worker),
run N lifecycles each: the trainer creates a ``Publisher``, adds its tensors and exports; the
inference process creates a ``Receiver``, adds its targets and refits once (the first transfer),
then closes; then the trainer closes. The model is created once per process and kept, as a test
fixture keeps its model. Pool on and ``WARMLINK_POOL=0`` (``pool.set_enabled(False)`` in both
children) run in the same invocation.

Every phase is timed inside its process with ``time.perf_counter`` (seconds); CUDA work is
synchronized before a phase ends. ``pool.stats()`` ``created`` deltas per lifecycle and process
show what each lifecycle created.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from warmlink.bench import args as bench_args
from warmlink.bench._proc import Group

__all__ = ["PHASES", "add_arguments", "created_delta", "make_tensors", "memory_need", "run", "run_lifecycles", "tensor_shape"]

# (row label, key in an iteration's flat phase dict); creation first, then destruction.
PHASES = (
    ("publisher create + add", "pub_create_s"), ("publisher export", "pub_export_s"),
    ("receiver create + add", "rec_create_s"), ("first refit: connect", "connect_s"), ("  sync", "sync_s"),
    ("  plan", "plan_s"), ("  alloc", "alloc_s"), ("  register", "register_s"), ("  pull", "pull_s"),
    ("  translate", "translate_s"), ("  install", "install_s"),
    ("receiver close", "rec_close_s"), ("publisher close", "pub_close_s"),
)
_CREATION = tuple(k for _l, k in PHASES[:11])
_DESTRUCTION = ("rec_close_s", "pub_close_s")


def tensor_shape(tensor_mib: float) -> tuple[int, int]:
    """Shape of one bf16 benchmark tensor of about ``tensor_mib`` MiB: ``(rows, 1024)``, rows >= 1."""
    return max(1, round(tensor_mib * (1 << 20) / 2 / 1024)), 1024


def make_tensors(num_tensors: int, tensor_mib: float, device, seed: int) -> dict:
    """``num_tensors`` bf16 tensors ``w000..`` of ``tensor_shape(tensor_mib)`` on ``device``.

    Values are seeded normals, the same in every process on the same device type. The caller owns
    the tensors (plain torch allocations).
    """
    import torch

    shape = tensor_shape(tensor_mib)
    out = {}
    for i in range(num_tensors):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
        out[f"w{i:03d}"] = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    return out


def memory_need(nbytes: int, tensor_nbytes: int, devices: tuple[int, int], install: str):
    """Peak memory of ``run_lifecycles`` moving ``nbytes`` in tensors of ``tensor_nbytes`` (a
    ``bench._memory.Need``): the trainer's model (staged into /dev/shm on the CPU), the inference
    model, its receive buffers (two sets with ``install="swap"``) and the last lifecycle's
    expectation; building a tensor makes a float32 copy of it for a moment."""
    from warmlink.bench._memory import Need

    buffers = nbytes * (2 if install == "swap" else 1)
    need = Need()
    need.on(devices[0], nbytes + 3 * tensor_nbytes)
    need.on(devices[1], 2 * nbytes + 3 * tensor_nbytes)
    if devices[0] < 0:
        need.shm_bytes += nbytes
    if devices[1] < 0:
        need.shm_bytes += buffers
    else:
        need.on(devices[1], buffers)
    need.host_bytes += need.shm_bytes
    need.processes(list(devices))
    return need


def created_delta(before: dict, after: dict) -> dict[str, int]:
    """``created`` per resource kind between two ``warmlink.pool.stats()`` snapshots."""
    return {k: v["created"] - before.get(k, {}).get("created", 0) for k, v in after.items()}


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _final(results, tag: str) -> None:
    from warmlink import pool
    from warmlink.pool import arenas, peers

    results.put({"tag": tag, "event": "final", "stats": pool.stats(), "open_mappings": peers.open_mappings(),
                 "live_shm": arenas.num_live_shm()})


def _trainer(*, control, results, address, secret, prefix, num_tensors, tensor_mib, device_idx, pool_on, backend, seed, timeout_s):
    from warmlink import pool
    from warmlink.bench._devices import device_of
    from warmlink.refit import Publisher
    from warmlink.rendezvous import Store

    pool.set_enabled(pool_on)
    device = device_of(device_idx)
    tensors = make_tensors(num_tensors, tensor_mib, device, seed)
    _sync(device)
    with Store.connect(address, prefix=prefix, timeout_s=timeout_s, secret=secret) as store:
        results.put({"tag": "trainer", "event": "ready"})
        pub, before = None, {}
        while (msg := control.get(timeout=timeout_s)) is not None:
            if msg[0] == "create":
                before = pool.stats()
                t0 = time.perf_counter()
                pub = Publisher(store, rank=0, world_size=1, backend=backend, timeout_s=timeout_s)
                for name, t in tensors.items():
                    pub.add(name, t)
                t1 = time.perf_counter()
                pub.export()
                _sync(device)
                t2 = time.perf_counter()
                results.put({"tag": "trainer", "event": "exported", "pub_create_s": t1 - t0, "pub_export_s": t2 - t1})
            elif msg[0] == "close":
                t0 = time.perf_counter()
                pub.close()
                _sync(device)
                close_s = time.perf_counter() - t0
                pub = None
                results.put({"tag": "trainer", "event": "closed", "pub_close_s": close_s,
                             "created": created_delta(before, pool.stats())})
            elif msg[0] == "final":
                _final(results, "trainer")


def _inference(*, control, results, address, secret, prefix, num_tensors, tensor_mib, device_idx, pool_on, backend, install,
               seed, timeout_s):
    import torch

    from warmlink import pool
    from warmlink.bench._devices import device_of
    from warmlink.refit import Receiver
    from warmlink.refit.manifest import TensorLayout
    from warmlink.rendezvous import Store

    pool.set_enabled(pool_on)
    device = device_of(device_idx)
    shape = tensor_shape(tensor_mib)
    layouts = {f"w{i:03d}": TensorLayout.plain(f"w{i:03d}", "bfloat16", shape) for i in range(num_tensors)}
    model = {name: torch.zeros(shape, dtype=torch.bfloat16, device=device) for name in layouts}
    _sync(device)
    with Store.connect(address, prefix=prefix, timeout_s=timeout_s, secret=secret) as store:
        results.put({"tag": "inference", "event": "ready"})
        while (msg := control.get(timeout=timeout_s)) is not None:
            if msg[0] == "cycle":
                verify = msg[2]
                if verify:
                    for t in model.values():
                        t.zero_()  # the verified lifecycle must deliver every byte itself
                    _sync(device)
                before = pool.stats()
                t0 = time.perf_counter()
                rec = Receiver(store, num_publishers=1, backend=backend, install=install, timeout_s=timeout_s)
                for name, layout in layouts.items():
                    rec.add(name, layout, model[name])
                t1 = time.perf_counter()
                report = rec.refit().as_dict()
                _sync(device)
                t2 = time.perf_counter()
                num_bad = 0
                if verify:
                    got = rec.tensors() if install == "swap" else model
                    expected = make_tensors(num_tensors, tensor_mib, device, seed)
                    num_bad = sum(not torch.equal(got[n].view(torch.int16), expected[n].view(torch.int16)) for n in layouts)
                    del expected
                t3 = time.perf_counter()
                rec.close()
                _sync(device)
                t4 = time.perf_counter()
                results.put({"tag": "inference", "event": "refitted", "rec_create_s": t1 - t0, "report": report,
                             "refit_s": t2 - t1, "rec_close_s": t4 - t3, "verified": verify, "num_bad": num_bad,
                             "created": created_delta(before, pool.stats())})
            elif msg[0] == "final":
                _final(results, "inference")


def run_lifecycles(
    *,
    iterations: int,
    num_tensors: int = 16,
    tensor_mib: float = 4.0,
    pool_on: bool = True,
    devices: tuple[int, int] = (0, 1),
    backend: str | None = None,
    install: str = "copy",
    seed: int = 0,
    timeout_s: float = 300.0,
    progress=None,
) -> dict:
    """Run ``iterations`` publisher/receiver lifecycles in one trainer and one inference process.

    Args:
        iterations: lifecycles (create -> first refit -> destroy), >= 1.
        num_tensors, tensor_mib: the model: that many bf16 tensors of about ``tensor_mib`` MiB each.
        pool_on: False runs both children with ``pool.set_enabled(False)`` (``WARMLINK_POOL=0``).
        devices: trainer and inference CUDA device indices; -1 = CPU (shm backend).
        backend: transport (default auto). install: the receiver's install mode.
        timeout_s: seconds any wait may take before the run fails.
        progress: optional callable taking the number of finished lifecycles.

    Returns:
        A JSON-able dict: ``pool``, ``iterations`` (one dict per lifecycle: every ``PHASES`` key in
        seconds, ``total_s`` (their sum), ``wall_s`` (parent clock, queue messages included),
        ``refit`` (the receiver's CycleReport dict), ``created`` ``{"trainer": {kind: n},
        "inference": {kind: n}}``), ``correct`` (bytes of the last lifecycle equal the trainer's)
        and ``final`` (each process's pool stats, open mappings and live shm arenas at the end).

    Raises:
        RuntimeError: a child failed, died or stalled past ``timeout_s`` (children are stopped).
    """
    from warmlink.rendezvous import Store

    prefix = f"bench-lifecycle-{'on' if pool_on else 'off'}-{time.monotonic_ns()}"
    rows, correct, final = [], True, {}
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix, timeout_s=timeout_s) as store, Group(timeout_s) as group:
        common = {"address": store.address, "secret": store.secret, "prefix": prefix, "num_tensors": num_tensors, "tensor_mib": tensor_mib,
                  "pool_on": pool_on, "backend": backend, "seed": seed, "timeout_s": timeout_s}
        group.start("trainer", _trainer, device_idx=devices[0], **common)
        group.start("inference", _inference, device_idx=devices[1], install=install, **common)
        group.expect("ready", 2)
        for i in range(1, iterations + 1):
            t0 = time.perf_counter()
            group.send("trainer", ("create", i))
            pub = group.expect("exported", 1)[0]
            group.send("inference", ("cycle", i, i == iterations))
            rec = group.expect("refitted", 1)[0]
            group.send("trainer", ("close", i))
            closed = group.expect("closed", 1)[0]
            wall_s = time.perf_counter() - t0
            row = {"iteration": i, "pub_create_s": pub["pub_create_s"], "pub_export_s": pub["pub_export_s"],
                   "rec_create_s": rec["rec_create_s"], **{k: rec["report"][k] for k in _CREATION[3:]},
                   "refit_total_s": rec["report"]["total_s"], "rec_close_s": rec["rec_close_s"],
                   "pub_close_s": closed["pub_close_s"]}
            row["total_s"] = (row["pub_create_s"] + row["pub_export_s"] + row["rec_create_s"] + row["refit_total_s"]
                              + row["rec_close_s"] + row["pub_close_s"])
            row.update(wall_s=wall_s, refit=rec["report"], created={"trainer": closed["created"], "inference": rec["created"]})
            rows.append(row)
            if rec["verified"]:
                correct = rec["num_bad"] == 0
            if progress is not None:
                progress(i)
        for tag in ("trainer", "inference"):
            group.send(tag, ("final",))
            final[tag] = {k: v for k, v in group.expect("final", 1)[0].items() if k not in ("tag", "event")}
    return {"pool": pool_on, "iterations": rows, "correct": correct, "final": final,
            "total_s": sum(r["total_s"] for r in rows), "wall_s": sum(r["wall_s"] for r in rows)}


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=100, help="lifecycles per mode (default 100)")
    p.add_argument("--tensors", type=int, default=16, help="tensors in the model (default 16)")
    p.add_argument("--tensor-mib", type=float, default=4.0, help="MiB per bf16 tensor (default 4)")
    p.add_argument("--devices", type=bench_args.devices, default=None,
                   help="trainer,inference CUDA devices, -1,-1 = CPU over shm (default: 0,1 on two or more GPUs, 0,0 "
                        "on one (colocated), -1,-1 without)")
    p.add_argument("--install", choices=("copy", "swap"), default="copy", help="receiver install mode (default copy)")
    p.add_argument("--backend", choices=("auto", "shm", "cuda_ipc", "nixl"), default="auto",
                   help="transport of both engines (default auto: cuda_ipc on GPUs, shm on CPU); nixl makes a NIXL agent "
                        "per link, the costliest endpoint to create")
    p.add_argument("--json", dest="json_path", default=None, help="write the JSON record here")
    p.add_argument("--plot", default=None, help="write a PNG chart (first lifecycles, phases stacked) here")
    p.add_argument("--seed", type=int, default=0, help="seed of the tensor values sent and checked (default 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any process may stall (default 300)")


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def _kinds(created: list[dict]) -> str:
    """Median created per kind over lifecycles, e.g. ``"arena 2, plan 1"``; ``"0"`` when nothing."""
    kinds = sorted({k for c in created for k in c})
    med = {k: statistics.median(c.get(k, 0) for c in created) for k in kinds}
    return ", ".join(f"{k} {v:g}" for k, v in med.items() if v) or "0"


def _phase_rows(on: dict, off: dict) -> list[dict]:
    from warmlink.bench.report import ratio

    on_warm, off_all = on["iterations"][1:] or on["iterations"], off["iterations"]
    rows = [{"phase": "creation"}]
    for label, key in PHASES:
        if key == "rec_close_s":
            rows.append({"phase": "destruction"})
        a, b = _median(on_warm, key), _median(off_all, key)
        rows.append({"phase": "  " + label, "pool on, 1st_s": on["iterations"][0][key], "pool on_s": a, "pool off_s": b,
                     "off / on": ratio(b, a)})
    for label, keys in (("creation total", _CREATION), ("destruction total", _DESTRUCTION), ("total per lifecycle", None)):
        col = (lambda r: r["total_s"]) if keys is None else (lambda r, ks=keys: sum(r[k] for k in ks))
        a = statistics.median(col(r) for r in on_warm)
        b = statistics.median(col(r) for r in off_all)
        rows.append({"phase": label, "pool on, 1st_s": col(on["iterations"][0]), "pool on_s": a, "pool off_s": b,
                     "off / on": ratio(b, a)})
    for side in ("trainer", "inference"):
        rows.append({"phase": f"created ({side})", "pool on, 1st_s": _kinds([on["iterations"][0]["created"][side]]),
                     "pool on_s": _kinds([r["created"][side] for r in on_warm]),
                     "pool off_s": _kinds([r["created"][side] for r in off_all])})
    return rows


def run(args: argparse.Namespace) -> int:
    """The ``warmlink bench lifecycle`` command: prints progress, the table and the N totals."""
    from warmlink.bench._memory import shortfall
    from warmlink.bench._devices import pick_devices
    from warmlink.bench.report import cycle_table, machine_info, ratio, write_record

    if args.iterations < 1 or args.tensors < 1 or not args.tensor_mib > 0:
        print("warmlink bench lifecycle: --iterations, --tensors and --tensor-mib must be positive", file=sys.stderr)
        return 2
    if args.devices is not None and (problem := bench_args.check_devices(args.devices)):
        return bench_args.refuse("warmlink bench lifecycle", problem)
    devices = pick_devices(args.devices)
    backend = getattr(args, "backend", "auto")
    where = "CPU" if devices[0] < 0 else f"cuda:{devices[0]} -> cuda:{devices[1]}"
    where += f" over {backend if backend != 'auto' else ('shm' if devices[0] < 0 else 'cuda_ipc')}"
    rows, cols = tensor_shape(args.tensor_mib)
    nbytes = args.tensors * rows * cols * 2
    short = shortfall(memory_need(nbytes, rows * cols * 2, devices, args.install),
                      "lower --tensors or --tensor-mib, or free memory")
    if short:
        return bench_args.refuse("warmlink bench lifecycle", short)
    print(f"warmlink bench lifecycle: {args.iterations} lifecycles x (publisher + receiver create -> first refit -> "
          f"close), {args.tensors} bf16 tensors, {nbytes / 2**20:.2f} MiB, {where}")
    record = {"bench": "lifecycle", "iterations": args.iterations, "num_tensors": args.tensors, "tensor_shape": [rows, cols],
              "nbytes": nbytes, "devices": list(devices), "install": args.install, "backend": backend, "modes": {},
              "machine": machine_info()}
    for name, pool_on in (("pool_on", True), ("pool_off", False)):
        t = time.perf_counter()
        label = f"  pool {'on ' if pool_on else 'off'}"

        def progress(i: int, label=label, t=t) -> None:
            if i == args.iterations or i % max(1, args.iterations // 4) == 0:
                print(f"{label}: {i}/{args.iterations} lifecycles ({time.perf_counter() - t:.1f} s)", flush=True)

        record["modes"][name] = run_lifecycles(
            iterations=args.iterations, num_tensors=args.tensors, tensor_mib=args.tensor_mib, pool_on=pool_on,
            devices=devices, backend=None if backend == "auto" else backend, install=args.install, seed=args.seed,
            timeout_s=args.timeout, progress=progress)
    on, off = record["modes"]["pool_on"], record["modes"]["pool_off"]
    table = _phase_rows(on, off)
    record["summary"] = table
    print()
    print(cycle_table(table, ["phase", "pool on, 1st_s", "pool on_s", "pool off_s", "off / on"],
                      title="engine lifecycle, per lifecycle (ms; pool on = median of lifecycles >= 2, "
                            "pool off = median of all)"))
    print()
    totals = [{"mode": "pool on", "lifecycles": len(on["iterations"]), "phases_s": on["total_s"], "wall_s": on["wall_s"],
               "open mappings at end": on["final"]["inference"]["open_mappings"]},
              {"mode": "pool off", "lifecycles": len(off["iterations"]), "phases_s": off["total_s"], "wall_s": off["wall_s"],
               "open mappings at end": off["final"]["inference"]["open_mappings"]}]
    print(cycle_table(totals, ["mode", "lifecycles", "phases_s", "wall_s", "open mappings at end"],
                      title=f"total for {args.iterations} lifecycles (ms; phases = sum of timed phases, wall = parent "
                            "clock with queue messages)"))
    record["totals"] = {"pool_on_s": on["total_s"], "pool_off_s": off["total_s"], "ratio": ratio(off["total_s"], on["total_s"])}
    print(f"pool off / pool on over {args.iterations} lifecycles: {record['totals']['ratio']:.2f}x"
          f"{'' if on['correct'] and off['correct'] else '  (INCORRECT BYTES)'}")
    if args.json_path:
        write_record(args.json_path, record)
        print(f"record: {args.json_path}")
    if args.plot:
        from warmlink.bench.report import plot_cycles

        keys = [k for _l, k in PHASES]
        methods = {m: {"cycles": [{"cycle": r["iteration"], **{k: r[k] for k in keys}, "total_s": r["total_s"]}
                                  for r in record["modes"][m]["iterations"][:8]]} for m in record["modes"]}
        plot_cycles({"title": "engine lifecycle: create -> first refit -> destroy", "methods": methods}, args.plot,
                    stacked=True)
        print(f"chart: {args.plot}")
    return 0 if on["correct"] and off["correct"] else 1
