"""``warmlink bench refit --hosts H``: one trainer into N engines across emulated hosts.

Prints, for each engine count N and each mode (Note [Refit modes] in ``bench.refit_hosts_roles``),
the warm cycle time (first engine's start to last engine's end, median of cycles 2..) beside its
bound: the copies of the model that must cross the trainer's link x bytes / link rate. The bound
counts payload only: TCP/IP headers add about 5% on the wire (the "sent" column shows the bytes
the trainer's link carried, headers included, in copies of the model). Beside them, one cycle
with the links' limit lifted: whether the links or something else (the CPU) bound the time, and
the run says which (Note [Link-bound] in ``bench.refit_hosts``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import signal
import textwrap
import time

from warmlink.bench import args as bench_args
from warmlink.bench.cluster import LINK_QUEUES

__all__ = ["DEFAULT_LINK_RATE_BPS", "add_arguments", "engine_counts", "link_rate", "plot_hosts", "run"]

_PROG = "warmlink bench refit --hosts"
DEFAULT_LINK_RATE_BPS = 200_000_000  # a 25 MB model, a second a copy: N = 1..8 pulled in about 3 minutes
_LINK_BOUND = 1.3  # within this of its bound (and far faster unlimited), a mode runs at its links' rate


def engine_counts(text: str) -> list[int]:
    """An argparse ``type``: engine counts as ``4``, ``1..8`` (a range, ends included) or ``1,2,4,8``."""
    expected = "a count (4), a range (1..8) or a comma list (1,2,4,8) of counts in [1, 64]"
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            counts = list(range(lo, hi + 1))
        else:
            counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not engine counts; expected {expected}") from None
    if not counts or min(counts) < 1 or max(counts) > 64 or counts != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"{text!r} out of range; expected {expected}, ascending")
    return counts


def link_rate(text: str) -> int:
    """An argparse ``type``: a link rate as tc writes it (``200mbit``), in bits per second."""
    from warmlink.bench.cluster import parse_rate
    from warmlink.errors import ConfigError

    try:
        return parse_rate(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a link rate; expected a number and bit, kbit, mbit or "
                                         "gbit, e.g. 200mbit") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the emulated-cluster mode, on ``bench refit``'s parser."""
    g = p.add_argument_group(
        "emulated cluster (--hosts; needs root, ip, tc, unshare, nsenter and warmlink[nixl])", textwrap.fill(
        "H hosts as network namespaces (own hostname, PID namespace and /dev/shm) on one bridge, each host's link "
        "limited to --link-rate both ways by tc; the trainer on host 0, engines on hosts 1..H-1 in blocks, NIXL "
        "over UCX TCP between them. For each engine count: the warm cycle time of every mode beside its bound "
        "(copies through the trainer's link x bytes / rate) and one cycle with the links' limit lifted (what the CPU "
        "allows), with progress lines while it runs. Modes: pull (every "
        "engine pulls from the trainer: N copies) and fanout (engines take the version from each other: one "
        "copy). --scale defaults to the largest model one second of the link carries; "
        "--cycles to 3 (the first is the newcomers' first refit). Example: --hosts 4 --engines 1..8 --plot hosts.png",
        width=96))
    g.add_argument("--hosts", type=bench_args.int_in(2, 250), default=None, metavar="H",
                   help="run on H emulated hosts (2 to 250) instead of this machine's devices")
    g.add_argument("--engines", type=engine_counts, default=None, metavar="N",
                   help="engine counts to time: 4, 1..8 or 1,2,4,8 (default 1..4). Without --hosts: one trainer "
                        "into N engine processes on --devices (engines alternate over the second device and the "
                        "first), pull beside fanout, e.g. --engines 1,3 --devices 0,1")
    g.add_argument("--link-rate", type=link_rate, default=None, metavar="RATE",
                   help="each host's link rate, each way, as tc writes it (default 200mbit)")
    g.add_argument("--link-queue", choices=LINK_QUEUES, default=None,
                   help="how a link queues behind its limit: small-first (default: packets under 512 bytes, such "
                        "as read requests and ACKs, before bulk ones, as a NIC or Linux's fq_codel serves them) or "
                        "fifo (one 100 ms FIFO, where a request waits behind another flow's bytes)")
    g.add_argument("--modes", default=None, metavar="LIST",
                   help="comma list of pull,fanout (default: both)")
    g.add_argument("--fanout-chunks", type=bench_args.int_in(1, 1 << 16), default=None, metavar="K",
                   help="--engines without --hosts: fan-out's pipeline unit, the model cut into K chunks (default: "
                        "FanOut's: 32 over CUDA IPC, 128 elsewhere)")


def _refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot run in the cluster mode, or None."""
    from warmlink.bench.refit_hosts_roles import MODES

    for flag, value in (("--scenarios", args.scenarios), ("--devices", args.devices), ("--install", args.install),
                        ("--nixl-threads", args.nixl_threads), ("--nixl-sweep", args.nixl_sweep),
                        ("--fanout-chunks", args.fanout_chunks)):
        if value is not None:
            return f"{flag} does not apply with --hosts (the cluster mode runs on host memory over nixl)"
    if args.backend != "auto":
        return "--backend does not apply with --hosts (the cluster mode always runs over nixl)"
    if args.modes is not None:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
            return f"--modes={args.modes!r} invalid; expected distinct modes from {','.join(MODES)}"
    if importlib.util.find_spec("nixl_cu13") is None and importlib.util.find_spec("nixl") is None:
        return "the cluster mode moves bytes over nixl, which is not installed (pip install warmlink[nixl])"
    from warmlink.bench.cluster import unavailable

    return unavailable()


@contextlib.contextmanager
def _sigterm_ends_the_run():
    """SIGTERM raises SystemExit while the cluster is up, so its teardown runs (Note [Cluster teardown])."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    try:
        before = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: SIGTERM stays as it was
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run(args: argparse.Namespace) -> int:
    from warmlink.bench.cluster import ClusterUnavailable
    from warmlink.bench.model_spec import qwen3_4b_like, scale_for_nbytes
    from warmlink.bench.refit_hosts import run_hosts_refit
    from warmlink.bench.refit_hosts_roles import MODES
    from warmlink.bench.report import machine_info, write_record

    if (problem := _refusal(args)) is not None:
        return bench_args.refuse(_PROG, problem)
    rate = args.link_rate if args.link_rate is not None else DEFAULT_LINK_RATE_BPS
    counts = args.engines if args.engines is not None else [1, 2, 3, 4]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip()) if args.modes else MODES
    cycles = args.cycles if args.cycles is not None else 3
    queue = args.link_queue or LINK_QUEUES[0]
    scale = args.scale if args.scale is not None else scale_for_nbytes(rate // 8)  # one second of a link
    spec = qwen3_4b_like(scale)
    copy_s = spec.nbytes * 8 / rate
    print(f"warmlink bench refit --hosts {args.hosts}: trainer on host 0, engines {counts[0]}..{counts[-1]} on hosts "
          f"1..{args.hosts - 1}, links {rate / 1e6:g} Mbit/s each way ({queue} queues); {spec.nbytes / 1e6:.2f} MB model "
          f"({len(spec.layouts(1, 0))} bf16 tensors, Qwen3-4B shape at scale {scale:.4g}), {cycles} cycles per count; "
          f"one copy through a link: {copy_s:.2f} s", flush=True)
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"  {time.perf_counter() - t0:6.1f} s  {line}", flush=True)

    try:
        with _sigterm_ends_the_run():
            record = run_hosts_refit(spec, num_hosts=args.hosts, engine_counts=counts, link_rate_bps=rate, link_queue=queue,
                                     modes=modes, cycles=cycles, seed=args.seed, timeout_s=args.timeout, progress=progress)
    except ClusterUnavailable as exc:
        return bench_args.refuse(_PROG, str(exc))
    record.update(bench="refit_hosts", spec=dict(spec.__dict__), scale=scale, machine=machine_info())
    for mode, rows in record["modes"].items():
        print()
        print(_table(mode, rows))
    print()
    for line in _verdicts(record):
        print(line)
    if args.json_path:
        write_record(args.json_path, record)
        print(f"record: {args.json_path}")
    if args.plot:
        plot_hosts(record, args.plot)
        print(f"chart: {args.plot}")
    return 0 if all(r["exact"] for rows in record["modes"].values() for r in rows) else 1


def _table(mode: str, rows: list[dict]) -> str:
    from warmlink.bench.report import cycle_table

    cells = [{"N": r["engines"], "warm s": f"{r['warm_s']:.3f}", "bound s": f"{r['bound_s']:.3f}",
              "x bound": f"{r['warm_s'] / r['bound_s']:.2f}", "unlimited s": f"{r['unlimited_s']:.3f}",
              "sent": f"{r['trainer_sent_x']:.2f}x", "bytes": "exact" if r["exact"] else "WRONG"} for r in rows]
    return cycle_table(cells, list(cells[0]), title=f"{mode}: {_TITLES.get(mode, mode)}")


_TITLES = {"pull": "every engine pulls from the trainer; bound = N x bytes / rate",
           "fanout": "engines take the version from each other; bound = bytes / rate"}


def _verdicts(record: dict) -> list[str]:
    """One line per mode: whether the links bound it (Note [Link-bound] in ``bench.refit_hosts``)."""
    out = []
    for mode, rows in record["modes"].items():
        ratios = [r["warm_s"] / r["bound_s"] for r in rows]
        worst = rows[max(range(len(rows)), key=lambda i: ratios[i])]
        free = max(r["unlimited_s"] / r["warm_s"] for r in rows)
        unlimited = f"with the limit lifted a cycle takes at most {100 * free:.0f}% of the limited one"
        if max(ratios) <= _LINK_BOUND and free < 0.5:
            out.append(f"{mode}: {min(ratios):.2f}-{max(ratios):.2f}x its bound at every N, and {unlimited}: the links "
                       "bound it, not the CPU")
        elif free < 0.5:
            out.append(f"{mode}: up to {max(ratios):.2f}x its bound (N={worst['engines']}), and {unlimited}: the links "
                       f"bound it, at {100 / max(ratios):.0f}% of their rate at worst")
        else:
            slow = rows[max(range(len(rows)), key=lambda i: rows[i]["unlimited_s"] / rows[i]["warm_s"])]
            within = (f"{min(ratios):.2f}-{max(ratios):.2f}x its bound at every N" if max(ratios) <= _LINK_BOUND
                      else f"up to {max(ratios):.2f}x its bound")
            out.append(f"{mode}: {within}, and at N={slow['engines']} the limit lifted leaves {100 * free:.0f}% of "
                       f"the cycle ({slow['unlimited_s']:.2f} s against {slow['warm_s']:.2f} s): the CPU, not only the "
                       "links, bounds it there; try a lower --link-rate")
        if not all(r["exact"] for r in rows):
            out.append(f"{mode}: WRONG BYTES in an engine (see the record)")
    return out


def plot_hosts(record: dict, path) -> None:
    """Time against N: a line per mode, and its bound dashed in the same colour; a PNG at ``path``."""
    from pathlib import Path

    from warmlink.errors import ConfigError

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plot_hosts: matplotlib is not installed; pip install warmlink[bench]") from None
    fig = Figure(figsize=(7.5, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels = {"pull": "every engine pulls from the trainer", "fanout": "fan-out"}
    for i, (mode, rows) in enumerate(record["modes"].items()):
        ns = [r["engines"] for r in rows]
        ax.plot(ns, [r["warm_s"] for r in rows], marker="o", color=f"C{i}", label=labels.get(mode, mode))
        ax.plot(ns, [r["bound_s"] for r in rows], linestyle="--", color=f"C{i}",
                label=f"bound: {'N x ' if mode == 'pull' else ''}bytes / rate")
        ax.plot(ns, [r["unlimited_s"] for r in rows], linestyle=":", marker=".", color=f"C{i}",
                label=f"{labels.get(mode, mode)}, links unlimited")
    ax.set_xticks(sorted({r["engines"] for rows in record["modes"].values() for r in rows}))
    ax.set_xlabel("engines (N)")
    ax.set_ylabel("warm cycle (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"refit across {record['num_hosts']} emulated hosts, {record['link_rate_bps'] / 1e6:g} Mbit/s links, "
                 f"{record['nbytes'] / 1e6:.1f} MB", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png")
