"""The commands a user runs first: --help, demo, bench refit and doctor, on this machine's CPU."""

from __future__ import annotations

import json

import pytest

from warmlink.cli.main import main


def test_help_explains_commands_and_switches(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("demo", "bench", "doctor", "WARMLINK_POOL", "WARMLINK_TIMEOUT_S"):
        assert word in out


def test_bench_refit_help_names_the_table(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "refit", "--help"])
    out = capsys.readouterr().out
    assert "--scale" in out and "alloc | register | pull" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_demo_refits_bit_exactly_on_cpu():
    from warmlink.cli.demo import run_demo

    lines: list[str] = []
    assert run_demo(steps=2, timeout_s=180, echo=lines.append)
    text = "\n".join(lines)
    assert "logits equal" in text and "OK: 2 refits" in text


def test_bench_refit_on_cpu_writes_a_record_and_warm_cycles_create_nothing(tmp_path, capsys):
    record_path = tmp_path / "refit.json"
    rc = main(["bench", "refit", "--scale", "0.001", "--cycles", "3", "--devices=-1,-1",
               "--scenarios", "peak,warm,cold,nccl", "--json", str(record_path), "--timeout", "120"])
    assert rc == 0
    record = json.loads(record_path.read_text())
    warm, cold = record["scenarios"]["warm"], record["scenarios"]["cold"]
    assert warm["correct"] and cold["correct"] and record["scenarios"]["nccl"]["correct"]
    assert all(sum(c["created"].values()) == 0 for c in warm["cycles"][1:])
    assert all(sum(c["created"].values()) > 0 for c in cold["cycles"])  # pool off: every cycle pays setup
    assert record["first_cycle"]["ratio"] > 0
    out = capsys.readouterr().out
    assert "summary" in out and "first cycle, setup included" in out


def test_bench_refit_rejects_unknown_scenarios(capsys):
    assert main(["bench", "refit", "--scenarios", "warm,bogus", "--devices=-1,-1"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_doctor_reports_backends(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend shm" in out and "backend cuda_ipc" in out


def test_help_loads_no_heavy_module():
    import subprocess
    import sys

    code = ("import sys; from warmlink.cli.main import build_parser; build_parser();"
            "print(','.join(m for m in ('transformers', 'torch.distributed', 'cuda.bindings', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
