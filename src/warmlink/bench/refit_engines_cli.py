"""``warmlink bench refit --engines N`` (no ``--hosts``): one trainer into N engine processes on this
machine's devices, every engine pulling from the trainer beside fan-out (``bench.fanout``).

The trainer runs on the first of ``--devices``; engines alternate over the second and the first
(``0,1`` with 3 engines: GPU1, GPU0, GPU1), so that on two GPUs some replicas share the trainer's
GPU and some sit across the link, as data-parallel rollouts do. Per engine count and mode: the
first cycle (it includes the mode's setup: plans, buffers, mappings), the warm cycle (median of
cycles >= 2, first engine's start to last engine's end), the warm cycle against one engine's in the
same mode, and the copies of the model the trainer sent per cycle. ``--install copy,swap`` times
each install mode in turn (copy keeps the engines' parameter addresses, as CUDA graphs need; swap
installs by pointing them at the received memory). Every mode is verified bit-exact against the
last version.
"""

from __future__ import annotations

import argparse
import statistics
import time

from warmlink.bench import args as bench_args

__all__ = ["run", "MODE_NAMES"]

_PROG = "warmlink bench refit --engines"
MODE_NAMES = {"pull": "trainer", "fanout": "fanout"}  # the flag's names (those of --hosts): bench.fanout's
INSTALLS = ("copy", "swap")  # the receivers' install modes fan-out takes


def engine_devices(devices: tuple[int, int], engines: int) -> tuple[int, ...]:
    """``(trainer, engine 1, ..., engine N)``: engines alternate over the engine device and the trainer's."""
    trainer, engine = devices
    cycle = (engine, trainer) if engine != trainer else (engine,)
    return (trainer, *(cycle[i % len(cycle)] for i in range(engines)))


def _refusal(args: argparse.Namespace) -> str | None:
    for flag, value in (("--link-rate", args.link_rate), ("--link-queue", args.link_queue), ("--plot", args.plot)):
        if value is not None:
            return f"{flag} needs --hosts (the emulated cluster)"
    if args.install is not None and (not args.install or any(m not in INSTALLS for m in args.install)):
        return (f"--install={','.join(args.install)!r} with --engines; expected modes from {','.join(INSTALLS)} (a relay "
                "serves its receive memory, which 'direct' does not keep)")
    for flag, value in (("--scenarios", args.scenarios), ("--nixl-threads", args.nixl_threads),
                        ("--nixl-sweep", args.nixl_sweep)):
        if value is not None:
            return f"{flag} does not apply with --engines (it times pull and fanout)"
    if args.backend != "auto":
        return "--backend does not apply with --engines (it times pull and fanout)"
    if args.modes is not None:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or any(m not in MODE_NAMES for m in modes) or len(set(modes)) != len(modes):
            return f"--modes={args.modes!r} invalid; expected distinct modes from {','.join(MODE_NAMES)}"
    if args.devices is not None:
        return bench_args.check_devices(args.devices)
    return None


def run(args: argparse.Namespace) -> int:
    from warmlink.bench._devices import pick_devices
    from warmlink.bench.fanout import run_fanout
    from warmlink.bench.model_spec import qwen3_4b_like
    from warmlink.bench.report import machine_info, write_record
    from warmlink.refit.fanout import MIN_CHUNK_BYTES

    if (problem := _refusal(args)) is not None:
        return bench_args.refuse(_PROG, problem)
    devices = pick_devices(args.devices)
    names = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else list(MODE_NAMES)
    modes = tuple(MODE_NAMES[m] for m in names)
    cycles = args.cycles if args.cycles is not None else 5
    scale = args.scale if args.scale is not None else (1.0 if devices[0] >= 0 else 0.02)
    spec = qwen3_4b_like(scale)
    where = "CPU over shm" if devices[0] < 0 else f"trainer on GPU{devices[0]}"
    chunk_bytes = None
    if args.fanout_chunks is not None:  # the bytes a receiver pulls: the model, TP 1 on both sides
        chunk_bytes = max(MIN_CHUNK_BYTES, -(-spec.nbytes // args.fanout_chunks))
    print(f"{_PROG} {','.join(map(str, args.engines))}: {where}; {spec.nbytes / 1e9:.3f} GB model "
          f"({len(spec.layouts(1, 0))} bf16 tensors, Qwen3-4B shape at scale {scale:g}), {cycles} cycles per mode, "
          f"modes {','.join(names)}" + (f", fan-out chunks of {chunk_bytes / 1e6:.1f} MB" if chunk_bytes else ""),
          flush=True)
    t0 = time.perf_counter()
    runs = []
    for install in args.install or ["copy"]:
        for n in args.engines:
            placed = engine_devices(devices, n)
            if devices[0] >= 0:
                print(f"  install={install}: {n} engine(s) on " + ", ".join(f"GPU{d}" for d in placed[1:]), flush=True)
            def progress(step, n=n, install=install):
                print(f"  {time.perf_counter() - t0:6.1f} s  {install} N={n} {step}", flush=True)

            out = run_fanout(spec, engines=n, modes=modes, cycles=cycles, devices=placed, timeout_s=args.timeout,
                             chunk_bytes=chunk_bytes, install=install, progress=progress)
            out["devices"] = list(placed)
            runs.append(out)
    record = {"bench": "refit_engines", "scale": scale, "spec": dict(spec.__dict__), "cycles": cycles, "runs": runs,
              "chunk_bytes": chunk_bytes,
              "machine": machine_info()}
    print()
    print(_table(runs, names, spec.nbytes))
    if args.json_path:
        write_record(args.json_path, record)
        print(f"record: {args.json_path}")
    return 0 if all(m["correct"] for r in runs for m in r["modes"].values()) else 1


def warm_s(rows: list[dict]) -> float:
    """The warm cycle of a mode's rows: the median wall time of cycles >= 2 (cycle 1 when it is alone)."""
    warm = [r["wall_s"] for r in rows if r["cycle"] >= 2] or [rows[0]["wall_s"]]
    return statistics.median(warm)


def _table(runs: list[dict], names: list[str], nbytes: int) -> str:
    head = (f"{'install':<8}{'engines':>7}  {'mode':<7}{'first (ms)':>11}{'warm (ms)':>11}{'vs 1 engine':>12}"
            f"{'GB/s per engine':>16}{'trainer sent (models)':>23}  exact")
    lines = [head]
    one = {}
    for r in runs:
        for name in names:
            rows = r["modes"][MODE_NAMES[name]]["cycles"]
            warm = warm_s(rows)
            key = (r["install"], name)
            if r["engines"] == 1:
                one[key] = warm
            ratio = f"{warm / one[key]:.2f}x" if key in one else "-"
            sent = statistics.median(row["trainer_nbytes"] for row in rows) / nbytes
            exact = "yes" if r["modes"][MODE_NAMES[name]]["correct"] else "NO"
            lines.append(f"{r['install']:<8}{r['engines']:>7}  {name:<7}{rows[0]['wall_s'] * 1e3:>11.1f}{warm * 1e3:>11.2f}"
                         f"{ratio:>12}{nbytes / warm / 1e9:>16.1f}{sent:>23.2f}  {exact}")
            if r["engines"] > 1 and name == "fanout":
                lines.append(_ends(rows[-1]))
    return "\n".join(lines)


def _ends(row: dict) -> str:
    """Where each replica took the last cycle from and when it ended: a chain's lag shows there."""
    ends = ", ".join(f"{e['replica']} <- {'/'.join(sorted(e['sources'])).replace('replica ', '')} {e['end_s'] * 1e3:.1f}"
                     for e in sorted(row["engines"], key=lambda e: e["replica"]))
    return f"{'':>17}cycle {row['cycle']}, replica <- source, end (ms): {ends}"
