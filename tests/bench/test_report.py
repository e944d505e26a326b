"""Tests of warmlink.bench.report: tables, stats, JSON records and the PNG chart."""

from __future__ import annotations

import json
import math
import sys

import pytest

from warmlink.bench import report
from warmlink.bench.report import cycle_table, gbps, machine_info, median, plot_cycles, ratio, read_record, write_record
from warmlink.errors import ConfigError

# The seed's "BEFORE FIX" rows, in seconds.
ROWS = [
    {"cycle": 1, "alloc_s": 0.032, "register_s": 0.152, "pull_s": 0.209, "translate_s": 0.016, "total_s": 0.409},
    {"cycle": 2, "alloc_s": 0.026, "register_s": 0.152, "pull_s": 0.203, "translate_s": 0.012, "total_s": 0.392},
    {"cycle": 3, "alloc_s": 0.001, "register_s": 0.024, "pull_s": 0.210, "translate_s": 0.011, "total_s": 0.246},
]
COLUMNS = ["cycle", "alloc_s", "register_s", "pull_s", "translate_s", "total_s"]


def test_plain_table_has_every_row_in_ms():
    text = cycle_table(ROWS, COLUMNS, "pool off", fancy=False)
    lines = text.splitlines()
    assert lines[0] == "pool off"
    assert lines[1].split() == ["cycle", "alloc", "(ms)", "register", "(ms)", "pull", "(ms)", "translate", "(ms)",
                                "total", "(ms)"]
    assert set(lines[2]) <= {"-", " "}
    body = [line.split() for line in lines[3:]]
    assert body == [
        ["1", "32.00", "152.00", "209.00", "16.00", "409.00"],
        ["2", "26.00", "152.00", "203.00", "12.00", "392.00"],
        ["3", "1.00", "24.00", "210.00", "11.00", "246.00"],
    ]
    # fixed width: every data line is as long as the header line, numbers right-aligned
    assert len({len(line) for line in lines[1:]}) == 1


def test_table_accepts_bare_phase_names_and_missing_values():
    rows = [{"cycle": 1, "pull_s": 0.0224, "pull_gbps": 394.04}, {"cycle": 2, "pull_s": None}]
    text = cycle_table(rows, ["cycle", "pull", "pull_gbps", "note"], "t", fancy=False)
    lines = text.splitlines()
    assert lines[1].split() == ["cycle", "pull", "(ms)", "pull", "(GB/s)", "note"]
    assert lines[3].split() == ["1", "22.40", "394.0", "-"]
    assert lines[4].split() == ["2", "-", "-", "-"]


def test_rich_table_contains_the_numbers():
    pytest.importorskip("rich")
    text = cycle_table(ROWS, COLUMNS, "pool on", fancy=True)
    for value in ("pool on", "alloc (ms)", "409.00", "392.00", "246.00", "24.00"):
        assert value in text


def test_table_needs_columns():
    with pytest.raises(ConfigError):
        cycle_table(ROWS, [], "x", fancy=False)


def test_auto_table_is_plain_when_not_a_tty(capsys):
    text = cycle_table(ROWS, COLUMNS, "auto")  # pytest captures stdout: not a TTY
    assert "\x1b[" not in text and text.splitlines()[0] == "auto"


def test_stats():
    assert ratio(0.392, 0.215) == pytest.approx(1.823, abs=1e-3)
    assert ratio(1.0, 0.0) == math.inf and math.isnan(ratio(0.0, 0.0))
    assert gbps(8_800_000_000, 0.0224) == pytest.approx(392.857, abs=1e-3)
    assert math.isnan(gbps(1, 0))
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1, 2, 3, 4]) == 2.5
    with pytest.raises(ConfigError):
        median([])


def test_machine_info_keys_and_no_paths(monkeypatch, tmp_path):
    import socket

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/warmlink", "bench", "refit", f"--out={tmp_path}/r.json",
                                      "/secret/home/plot.png"])
    info = machine_info()
    for key in ("gpu_names", "gpu_count", "torch_version", "cuda_version", "nccl_version", "date_utc",
                "python_version", "argv", "host_id"):
        assert key in info
    assert info["argv"] == ["warmlink", "bench", "refit", "--out=r.json", "plot.png"]
    text = json.dumps(info)
    assert socket.gethostname() not in text and str(tmp_path) not in text and "/secret" not in text
    assert info["date_utc"].endswith("+00:00")


def test_record_round_trip(tmp_path):
    rec = {"bench": "refit", "methods": {"nccl per tensor": {"cycles": ROWS}}, "nan": math.nan, "shape": (2, 3)}
    path = write_record(tmp_path / "sub" / "refit.json", rec)
    back = read_record(path)
    assert back["schema_version"] == report.RECORD_SCHEMA_VERSION
    assert back["methods"]["nccl per tensor"]["cycles"] == ROWS
    assert back["nan"] is None and back["shape"] == [2, 3]
    assert {"gpu_names", "torch_version", "nccl_version", "date_utc", "argv"} <= set(back["machine"])
    assert json.loads(path.read_text()) == back
    assert [p.name for p in path.parent.iterdir()] == ["refit.json"]  # no temp file left


def test_record_keeps_given_machine_and_rejects_objects(tmp_path):
    back = read_record(write_record(tmp_path / "r.json", {"machine": {"gpu_names": ["H200"]}}))
    assert back["machine"] == {"gpu_names": ["H200"]}
    with pytest.raises(ConfigError, match="record.bad"):
        write_record(tmp_path / "bad.json", {"bad": object()})
    with pytest.raises(ConfigError):
        write_record(tmp_path / "bad.json", [1, 2])
    (tmp_path / "old.json").write_text('{"schema_version": 99}')
    with pytest.raises(ConfigError, match="schema_version"):
        read_record(tmp_path / "old.json")


def _plot_record() -> dict:
    def cycles(total):
        return [{"cycle": i + 1, "alloc_s": 0.001, "transfer_s": t - 0.001, "total_s": t} for i, t in enumerate(total)]

    return {
        "title": "refit 8.8 GB, 290 tensors",
        "methods": {
            "warmlink pool on": {"cycles": cycles([0.160, 0.0225, 0.0224])},
            "warmlink pool off": {"cycles": cycles([0.180, 0.170, 0.171])},
            "NCCL per tensor": {"cycles": cycles([0.040, 0.0273, 0.0273])},
            "NCCL bucket": {"cycles": cycles([0.050, 0.0295, 0.0295])},
        },
        "peak_s": 0.0224,
        "peak_label": "copy-engine peak 394 GB/s",
    }


@pytest.mark.parametrize("stacked", [False, True])
def test_plot_writes_png(tmp_path, stacked):
    pytest.importorskip("matplotlib")
    path = plot_cycles(_plot_record(), tmp_path / "out" / "refit.png", stacked=stacked)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_accepts_method_list(tmp_path):
    pytest.importorskip("matplotlib")
    rec = {"methods": [{"label": "a", "cycles": [{"cycle": 1, "total_s": 0.01}]}]}
    assert plot_cycles(rec, tmp_path / "a.png").stat().st_size > 0


def test_plot_without_matplotlib_is_a_config_error(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install warmlink\[bench\]"):
        plot_cycles(_plot_record(), tmp_path / "x.png")


def test_plot_needs_methods(tmp_path):
    with pytest.raises(ConfigError, match="methods"):
        plot_cycles({"methods": {}}, tmp_path / "x.png")


def test_table_known_phase_names_are_seconds():
    rows = [{"cycle": 1, "alloc": 0.032, "total": 0.409, "loss": 10.8234, "GB/s": 321.456, "created": "group"},
            {"cycle": 2, "alloc": 0.0, "total": 0.215, "loss": 9.5, "GB/s": 611.9, "created": 0}]
    lines = cycle_table(rows, ["cycle", "alloc", "total", "loss", "GB/s", "created"], "t", fancy=False).splitlines()
    assert lines[1].split() == ["cycle", "alloc", "(ms)", "total", "(ms)", "loss", "GB/s", "created"]
    assert lines[3].split() == ["1", "32.00", "409.00", "10.82", "321.5", "group"]
    assert lines[4].split() == ["2", "0.00", "215.00", "9.5", "611.9", "0"]
    # seconds= overrides the defaults
    lines = cycle_table(rows, ["cycle", "loss"], "t", seconds=["loss"], fancy=False).splitlines()
    assert lines[3].split() == ["1", "10823.40"]


def test_plot_scenarios_record_with_nccl_result_and_peak(tmp_path):
    pytest.importorskip("matplotlib")
    nccl = {"mode": "per_tensor", "init_s": 0.2, "first_collective_s": 0.63, "group_init_s": 0.83, "correct": True,
            "cycles": [{"cycle": c, "alloc_s": 0.0, "pack_s": 0.0, "transfer_s": 0.0273, "unpack_s": 0.0,
                        "total_s": 0.0273} for c in (1, 2, 3)]}
    rec = {"nbytes": 8_800_000_000, "scenarios": {"peak": {"gbps": 394.0}, "nccl": nccl,
                                                  "warm": {"cycles": [{"cycle": 1, "total_s": 0.3}], "correct": False}}}
    methods = report._methods(rec)
    assert [m[0] for m in methods] == ["nccl", "warm (INCORRECT)"]
    assert methods[0][1][0]["total_s"] == pytest.approx(0.8573) and methods[0][1][1]["total_s"] == 0.0273
    assert nccl["cycles"][0]["total_s"] == 0.0273  # the caller's record is not modified
    peak_s, label = report._peak(rec)
    assert peak_s == pytest.approx(8.8 / 394.0) and "394" in label
    for stacked in (False, True):
        assert plot_cycles(rec, tmp_path / f"s{stacked}.png", stacked=stacked).stat().st_size > 5000


def test_a_method_with_a_label_is_drawn_under_it_not_under_its_key():
    """The refit bench's gloo baseline on CPU sits under the key "nccl"; its legend says gloo."""
    rec = {"scenarios": {"nccl": {"label": "gloo per tensor", "cycles": [{"cycle": 1, "total_s": 0.01}]},
                         "warm": {"cycles": [{"cycle": 1, "total_s": 0.02}]}}}
    assert [label for label, _ in report._methods(rec)] == ["gloo per tensor", "warm"]
