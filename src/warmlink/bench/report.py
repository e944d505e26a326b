"""Rendering shared by every ``warmlink bench``: cycle tables, JSON records, PNG charts, small stats.

The render functions return strings (the CLI prints them); nothing here prints. ``rich`` and
``matplotlib`` are optional (``pip install warmlink[bench]``) and imported only when used.

Column conventions of ``cycle_table`` (see ``SECONDS_COLUMNS``): a column holds seconds, shown in
milliseconds with 2 decimals under ``x (ms)``, when it is named ``x_s``, when the rows hold ``x_s``
instead of ``x``, when it is a known phase name (``alloc``, ``pull``, ``total``, ...) or when the
caller lists it in ``seconds=``. ``x_gbps`` and ``GB/s`` columns are shown with 1 decimal. Anything
else is shown as is (floats with 4 significant digits, 1 decimal from 100 up).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import logging
import math
import os
import platform
import socket
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from warmlink.errors import ConfigError

__all__ = [
    "cycle_table",
    "ratio",
    "gbps",
    "median",
    "machine_info",
    "write_record",
    "read_record",
    "plot_cycles",
    "RECORD_SCHEMA_VERSION",
    "SECONDS_COLUMNS",
]

log = logging.getLogger("warmlink.bench")

RECORD_SCHEMA_VERSION = 1
_MISSING = "-"
# Bare column names that hold seconds in every warmlink table (phases of a cycle, summaries).
SECONDS_COLUMNS = frozenset({
    "connect",
    "sync", "plan", "alloc", "register", "pull", "pack", "transfer", "unpack", "translate", "install",
    "total", "warm", "cold", "setup", "export", "init", "first_collective", "group_init", "cycle 1",
})


# ---------------------------------------------------------------------------------------- tables
def _column_spec(col: str, rows: Sequence[dict], seconds: frozenset[str]) -> tuple[str, str, str]:
    """``(key in the rows, header, kind)`` with kind one of ``"s"``, ``"gbps"``, ``"raw"``."""
    if col.endswith("_s"):
        return col, f"{col[:-2]} (ms)", "s"
    if col.endswith("_gbps"):
        return col, f"{col[:-5]} (GB/s)", "gbps"
    if col == "GB/s":
        return col, col, "gbps"
    if any(col not in r and f"{col}_s" in r for r in rows):
        return f"{col}_s", f"{col} (ms)", "s"
    if col in seconds:
        return col, f"{col} (ms)", "s"
    return col, col, "raw"


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return _MISSING
    if kind in ("s", "gbps") and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            return str(value)
        return f"{value * 1e3:.2f}" if kind == "s" else f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def cycle_table(
    rows: list[dict],
    columns: list[str],
    title: str,
    *,
    seconds: Iterable[str] | None = None,
    fancy: bool | None = None,
) -> str:
    """Render per-cycle phase timings as the seed's table (cycle | alloc | ... | total).

    Args:
        rows: one dict per row, e.g. a ``run_nccl_refit`` result's ``cycles``; seconds as floats.
        columns: keys to show, in order, e.g. ``["cycle", "alloc_s", "pack_s", "transfer_s",
            "unpack_s", "total_s"]`` (see the module docstring for units); a key missing from a
            row shows ``-``.
        title: the line printed above the table.
        seconds: bare column names that hold seconds (default ``SECONDS_COLUMNS``).
        fancy: ``True``: a ``rich`` table (with ANSI colours); ``False``: plain fixed-width text;
            ``None`` (default): ``rich`` when it is importable and stdout is a TTY.

    Returns:
        The table as one string without a trailing newline; the caller prints it.

    Raises:
        ConfigError: ``columns`` is empty, or ``fancy=True`` and ``rich`` is not installed.
    """
    if not columns:
        raise ConfigError("cycle_table: columns=[] is empty; expected at least one column name")
    secs = SECONDS_COLUMNS if seconds is None else frozenset(seconds)
    specs = [_column_spec(c, rows, secs) for c in columns]
    cells = [[_cell(r.get(key), kind) for key, _h, kind in specs] for r in rows]
    if fancy is None:
        fancy = _rich_available() and sys.stdout.isatty()
    if fancy:
        return _rich_table(specs, cells, title)
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (_k, h, _kind) in enumerate(specs)]
    numeric = [kind != "raw" or all(_is_number(r.get(key)) for r in rows) for key, _h, kind in specs]

    def line(values: Iterable[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [title, line(h for _k, h, _kind in specs), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _rich_table(specs: list[tuple[str, str, str]], cells: list[list[str]], title: str) -> str:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        raise ConfigError("cycle_table: fancy=True needs rich; pip install warmlink[bench]") from None
    table = Table(title=title, title_justify="left")
    for _key, header, kind in specs:
        table.add_column(header, justify="left" if kind == "raw" else "right")
    for row in cells:
        table.add_row(*row)
    buf = io.StringIO()
    Console(file=buf, force_terminal=True, width=200).print(table)
    return buf.getvalue().rstrip("\n")


# ----------------------------------------------------------------------------------------- stats
def ratio(a: float, b: float) -> float:
    """``a / b`` (e.g. baseline seconds / warmlink seconds = speed-up); ``inf`` when b == 0 < a, NaN for 0/0."""
    if b == 0:
        return math.nan if a == 0 else math.copysign(math.inf, a)
    return a / b


def gbps(nbytes: int | float, seconds: float) -> float:
    """Throughput in GB/s (1 GB = 1e9 bytes) of ``nbytes`` bytes moved in ``seconds``; NaN when seconds <= 0."""
    if seconds <= 0:
        return math.nan
    return nbytes / seconds / 1e9


def median(xs: Iterable[float]) -> float:
    """Median of a non-empty sequence of numbers; ConfigError when empty."""
    values = list(xs)
    if not values:
        raise ConfigError("median: xs is empty; expected at least one value")
    return float(statistics.median(values))


# --------------------------------------------------------------------------------------- records
def _scrub_arg(arg: str, cwd: str) -> str:
    """Remove machine paths from one argv entry: absolute paths become relative to cwd, else basename."""
    prefix, sep, value = arg.partition("=") if arg.startswith("-") and "=" in arg else ("", "", arg)
    if os.path.isabs(value):
        inside = os.path.commonpath([cwd, value]) == cwd if cwd else False
        value = os.path.relpath(value, cwd) if inside else os.path.basename(value.rstrip(os.sep)) or value
    return f"{prefix}{sep}{value}"


def machine_info() -> dict[str, Any]:
    """What a benchmark figure needs to be reproduced, without hostnames or paths.

    Returns:
        A JSON-able dict: ``gpu_names`` (list), ``gpu_count``, ``torch_version``, ``cuda_version``,
        ``nccl_version`` (``"2.28.3"`` or None), ``python_version``, ``platform``, ``cpu_count``,
        ``host_id`` (first 12 hex digits of the hostname's SHA-256: tells runs apart, names no
        machine), ``date_utc`` (ISO 8601), ``argv`` (the command line; argv[0] reduced to its name
        and absolute paths made relative to the working directory or reduced to their names).

    Blocking? Queries the CUDA runtime (device names) when CUDA is available; creates no stream.
    """
    info: dict[str, Any] = {
        "gpu_names": [],
        "gpu_count": 0,
        "torch_version": None,
        "cuda_version": None,
        "nccl_version": None,
    }
    try:
        import torch

        info["torch_version"] = torch.__version__
        info["cuda_version"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(info["gpu_count"])]
        try:
            nccl = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(str(p) for p in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # noqa: BLE001 - CPU builds have no NCCL; the field stays None
            pass
    except ImportError:
        pass
    cwd = os.getcwd()
    argv = list(sys.argv)
    info.update(
        python_version=platform.python_version(),
        platform=platform.platform(terse=True),
        cpu_count=os.cpu_count(),
        host_id=hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12],
        date_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        argv=([os.path.basename(argv[0])] if argv else []) + [_scrub_arg(a, cwd) for a in argv[1:]],
    )
    return info


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"write_record: key={k!r} at {where} is not a str; expected JSON object keys")
            out[k] = _jsonable(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise ConfigError(
        f"write_record: value at {where} has type {type(value).__name__}; expected JSON data "
        "(dict, list, str, int, float, bool, None), never tensors or objects"
    )


def write_record(path: str | os.PathLike, record: dict) -> Path:
    """Write one benchmark record as JSON, with ``machine_info()`` and a schema version.

    Args:
        path: file to write (parent folders are created); replaced atomically.
        record: JSON-able data of the run. A ``"machine"`` entry, if present, is kept (e.g.
            collected on the GPU host); otherwise ``machine_info()`` of this process is added.
            Non-finite floats are written as ``null``.

    Returns:
        The path written.

    Raises:
        ConfigError: ``record`` is not a dict or holds something that is not JSON data.
    """
    if not isinstance(record, dict):
        raise ConfigError(f"write_record: record has type {type(record).__name__}; expected a dict")
    out = {"schema_version": RECORD_SCHEMA_VERSION, **record}
    out["machine"] = record.get("machine") or machine_info()
    text = json.dumps(_jsonable(out, "record"), indent=2, allow_nan=False) + "\n"
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)
    log.info("write_record: wrote %d bytes to %s", len(text), target.name)
    return target


def read_record(path: str | os.PathLike) -> dict:
    """Read a record written by ``write_record``; ConfigError if it is not one of a known version."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"read_record: path={str(path)!r} is not readable JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema_version") != RECORD_SCHEMA_VERSION:
        version = data.get("schema_version") if isinstance(data, dict) else None
        raise ConfigError(
            f"read_record: schema_version={version!r} is unknown; expected {RECORD_SCHEMA_VERSION}"
        )
    return data


# ----------------------------------------------------------------------------------------- plots
def _methods(record: dict) -> list[tuple[str, list[dict]]]:
    """``(label, cycles)`` per method; a top-level ``group_init_s`` is added to cycle 1 as a phase."""
    methods = record.get("methods", record.get("scenarios"))
    if isinstance(methods, dict):
        items = [(str(v.get("label", k)), v) for k, v in methods.items() if isinstance(v, dict)]
    elif isinstance(methods, list):
        items = [(str(m.get("label", f"method {i}")), m) for i, m in enumerate(methods) if isinstance(m, dict)]
    else:
        items = []
    out = []
    for label, m in items:
        if not isinstance(m.get("cycles"), list):
            continue  # e.g. a "peak" scenario: drawn as the line, not as bars
        cycles = [dict(c) for c in m["cycles"] if isinstance(c, dict)]
        group_init = m.get("group_init_s")
        if isinstance(group_init, (int, float)) and cycles:
            total = float(cycles[0].get("total_s") or 0.0) + group_init
            cycles[0] = {"group_init_s": group_init, **cycles[0], "total_s": total}
        out.append((label if m.get("correct", True) is not False else f"{label} (INCORRECT)", cycles))
    if not out:
        raise ConfigError(
            "plot_cycles: record['methods'] (or 'scenarios') has no method with 'cycles'; expected "
            "{label: {'cycles': [{'cycle': 1, 'total_s': ...}, ...]}}"
        )
    return out


def _peak(record: dict) -> tuple[float | None, str]:
    """Seconds of the record's bytes at peak bandwidth: ``peak_s``, else a method with ``gbps``."""
    peak_s, label = record.get("peak_s"), record.get("peak_label")
    if not isinstance(peak_s, (int, float)):
        nbytes = record.get("nbytes", record.get("bytes"))
        methods = record.get("methods", record.get("scenarios"))
        for name, m in (methods.items() if isinstance(methods, dict) else ()):
            rate = m.get("gbps", m.get("one_way_gbps")) if isinstance(m, dict) and "cycles" not in m else None
            if isinstance(rate, (int, float)) and isinstance(nbytes, (int, float)) and rate > 0:
                peak_s, label = nbytes / (rate * 1e9), label or f"{name}: {rate:.0f} GB/s"
                break
    if isinstance(peak_s, (int, float)) and math.isfinite(peak_s) and peak_s > 0:
        return float(peak_s), str(label or f"peak {peak_s * 1e3:.1f} ms")
    return None, ""


def plot_cycles(record: dict, path: str | os.PathLike, *, stacked: bool = False) -> Path:
    """Draw per-cycle time of each method as grouped bars, and save a PNG.

    Args:
        record: ``{"title": str (optional), "methods": {label: {"cycles": [{"cycle": 1,
            "total_s": s, "alloc_s": s, ...}, ...]}, ...}, "peak_s": s (optional), "peak_label":
            str (optional)}``. ``methods`` may be named ``scenarios`` and may be a list of dicts
            with a ``label``; a ``run_nccl_refit`` result is a valid method, and its
            ``group_init_s`` is drawn as part of cycle 1. Without ``peak_s``, a method without
            cycles but with ``gbps`` (or ``one_way_gbps``) and the record's ``nbytes`` give the
            peak. The peak is drawn as a horizontal line. Unstacked, the y axis turns
            logarithmic when the bars span more than 30x.
        path: PNG file to write (parent folders are created).
        stacked: stack the phase times (every ``*_s`` key but ``total_s``) inside each bar,
            coloured by phase, instead of one bar per method coloured by method.

    Returns:
        The path written.

    Raises:
        ConfigError: matplotlib is missing (``pip install warmlink[bench]``) or the record has
            no method with cycles.
    """
    methods = _methods(record)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plot_cycles: matplotlib is not installed; pip install warmlink[bench]") from None
    cycles = sorted({int(c.get("cycle", i + 1)) for _l, cs in methods for i, c in enumerate(cs)})
    phases: list[str] = []
    for _label, cs in methods:
        for c in cs:
            phases.extend(k for k in c if k.endswith("_s") and k != "total_s" and k not in phases)
    stacked = stacked and bool(phases)
    # a colour per phase: matplotlib's default cycle repeats after 10, the lifecycle has 13 phases
    from matplotlib import colormaps

    palette = colormaps["tab20"] if len(phases) > 10 else (lambda i: f"C{i}")
    fig = Figure(figsize=(max(7.5, 3.0 + 0.45 * len(cycles) * len(methods)), 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(methods)
    bar_xs: list[float] = []
    bar_labels: list[str] = []
    all_totals: list[float] = []
    for m_idx, (label, cs) in enumerate(methods):
        by_cycle = {int(c.get("cycle", i + 1)): c for i, c in enumerate(cs)}
        xs = [x + (m_idx - (len(methods) - 1) / 2) * width for x in range(len(cycles))]
        totals = [_ms(by_cycle.get(cyc, {}).get("total_s")) for cyc in cycles]
        bar_xs += xs
        bar_labels += [label] * len(xs)
        all_totals += totals
        if stacked:
            bottom = [0.0] * len(cycles)
            for p_idx, ph in enumerate(phases):
                vals = [_ms(by_cycle.get(cyc, {}).get(ph)) for cyc in cycles]
                ax.bar(xs, vals, width, bottom=bottom, color=palette(p_idx), edgecolor="white", linewidth=0.5,
                       label=ph[:-2] if m_idx == 0 else None)
                bottom = [b + v for b, v in zip(bottom, vals)]
            for x, t, top in zip(xs, totals, bottom):  # on its stack (phases may overlap: not at the total)
                ax.text(x, top, f"{t:.1f}" if t else "", ha="center", va="bottom", fontsize=6)
            all_totals[-len(totals):] = [max(t, top) for t, top in zip(totals, bottom)]  # the axis holds the stacks
        else:
            bars = ax.bar(xs, totals, width, color=f"C{m_idx % 10}", label=label)
            ax.bar_label(bars, labels=[f"{t:.1f}" if t else "" for t in totals], fontsize=6, padding=1)
    peak_s, peak_label = _peak(record)
    if peak_s is not None:
        ax.axhline(peak_s * 1e3, color="black", linestyle="--", linewidth=1, label=peak_label)
    positive = [t for t in all_totals if t > 0]
    if not stacked and positive and max(positive) > 30 * min(positive):  # stacks only read on a linear axis
        ax.set_yscale("log")
        ax.set_ylim(top=max(positive) * 1.6)
    elif positive:
        ax.set_ylim(0, max(max(positive), (peak_s or 0) * 1e3) * 1.12)  # room for the value labels
    cycle_labels = [f"cycle {c}" for c in cycles]
    if stacked:  # phases own the colours: name each bar, put the cycles on top
        ax.set_xticks(bar_xs, bar_labels, rotation=60, ha="right", fontsize=7)
        top = ax.secondary_xaxis("top")
        top.set_xticks(range(len(cycles)), cycle_labels)
        top.tick_params(length=0)
    else:
        ax.set_xticks(range(len(cycles)), cycle_labels)
    ax.set_ylabel("time per cycle (ms)")
    ax.set_title(str(record.get("title") or "refit cycles"))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png")
    log.info("plot_cycles: wrote %s", target.name)
    return target


def _ms(seconds: Any) -> float:
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds):
        return float(seconds) * 1e3
    return 0.0
