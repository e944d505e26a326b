"""The commands a user runs first: --help, demo, bench refit and doctor on this machine's CPU, and the README's
test command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from warmlink.cli.main import main


def test_the_readme_test_command_is_what_ci_runs():
    """The README's test command (the block after "Run the tests") runs in ``.ci/run`` exactly as written."""
    root = Path(__file__).resolve().parents[2]
    (block,) = re.findall(r"Run the tests[^\n]*\n\n```bash\n(.*?)```", (root / "README.md").read_text(), flags=re.S)
    assert block.strip() in (root / ".ci" / "run").read_text()


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


def test_bench_alone_prints_the_bench_help_and_fails(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: warmlink bench") and "reconfigure" in out and "manifest" in out


def test_the_help_prints_percent_signs_once(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "at 5% size" in out and "%%" not in out


@pytest.mark.parametrize("bench", ["refit", "lifecycle", "reconfigure"])
def test_devices_of_host_processes_parse_as_the_help_writes_them(bench):
    """``--devices -1,-1`` (the help's spelling), not only ``--devices=-1,-1``: argparse alone reads
    ``-1,-1`` as an option."""
    from warmlink.cli.main import _joined, build_parser

    args = build_parser().parse_args(_joined(["bench", bench, "--devices", "-1,-1"]))
    assert args.devices == (-1, -1)


def test_deep_ep_with_low_latency_is_refused_saying_why(capsys):
    assert main(["bench", "ep", "--low-latency", "--deep-ep"]) == 2
    assert "--deep-ep times normal-mode calls" in capsys.readouterr().err


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
    first = record["first_cycle"]
    assert first["ratio"] > 0 and first["joining_s"] == warm["cycles"][0]["total_s"]
    assert first["joining_s"] < first["warmlink_s"]
    out = capsys.readouterr().out
    assert "summary" in out and "first cycle, setup included" in out and "an engine joining a running job" in out
    assert "of gloo group creation" in out and "NCCL" not in out  # on CPU the broadcast baseline is gloo's
    assert record["scenarios"]["nccl"]["label"] == "gloo per tensor"  # the chart's legend


def test_bench_refit_rejects_unknown_scenarios(capsys):
    assert main(["bench", "refit", "--scenarios", "warm,bogus", "--devices=-1,-1"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_doctor_reports_backends(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend shm" in out and "backend cuda_ipc" in out
    assert "ep host steps: " in out  # compiled or Python, and why


def test_help_loads_no_heavy_module():
    import subprocess
    import sys

    code = ("import sys; from warmlink.cli.main import build_parser; build_parser();"
            "print(','.join(m for m in ('transformers', 'torch.distributed', 'cuda.bindings', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""


# -- bad values: one line naming the flag or variable, exit code 2, before anything starts ----------
def _warmlink(args: list[str], **env: str):
    """``python -m warmlink.cli.main ARGS`` with no WARMLINK_* variable but ``env``'s."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("WARMLINK_")}
    return subprocess.run([sys.executable, "-m", "warmlink.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env={**clean, **env})


def _one_line_naming(done, name: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and name in lines[0], done.stderr
    return lines[0]


@pytest.mark.parametrize("args,flag", [
    (["bench", "refit", "--scale", "-1"], "--scale"),
    (["bench", "refit", "--scale", "2"], "--scale"),
    (["bench", "refit", "--devices", "0"], "--devices"),
    (["bench", "refit", "--cycles", "0"], "--cycles"),
    (["bench", "refit", "--timeout", "nan"], "--timeout"),
    (["bench", "ep", "--hidden", "100"], "--hidden"),
    (["bench", "ep", "--tokens", "-5"], "--tokens"),
    (["bench", "ep", "--ranks", "0"], "--ranks"),
    (["bench", "ep", "--experts", "6", "--ranks", "4"], "--experts=6"),
    (["bench", "ep", "--topk", "9", "--experts", "8", "--ranks", "2"], "--topk=9"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--timeout", "-3"], "--timeout"),
])
def test_a_bad_flag_is_one_line_naming_it_and_exit_code_2(args, flag):
    done = _warmlink(args)
    _one_line_naming(done, flag)
    assert done.stdout == ""  # nothing started


def test_devices_without_cuda_are_refused_before_any_process_starts():
    done = _warmlink(["bench", "refit", "--devices", "0,1"], CUDA_VISIBLE_DEVICES="")
    assert "needs CUDA" in _one_line_naming(done, "--devices=0,1")
    assert done.stdout == ""


def test_a_bad_variable_ends_the_demo_at_once():
    done = _warmlink(["demo"], WARMLINK_BACKEND="bogus")
    assert "'bogus' is unknown" in _one_line_naming(done, "WARMLINK_BACKEND")
    assert done.stdout == ""


_BAD_VARIABLES = {"WARMLINK_POOL": "2", "WARMLINK_BACKEND": "bogus", "WARMLINK_TIMEOUT_S": "-1",
                  "WARMLINK_LOG_LEVEL": "LOUD", "WARMLINK_NIXL_THREADS": "999", "WARMLINK_EP_COPY_STREAMS": "two",
                  "WARMLINK_EP_SEND": "dma", "WARMLINK_EP_GRAPH": "yes", "WARMLINK_EP_STREAM_KERNEL": "cutlass",
                  "WARMLINK_EP_HOST": "rust",
                  "WARMLINK_CACHE_DIR": "relative/dir", "WARMLINK_SECRET": "too-short"}


@pytest.mark.parametrize("name", sorted(_BAD_VARIABLES))
def test_every_command_refuses_each_bad_variable_before_it_starts(name, monkeypatch, capsys):
    for other in [k for k in __import__("os").environ if k.startswith("WARMLINK_")]:
        monkeypatch.delenv(other)
    monkeypatch.setenv(name, _BAD_VARIABLES[name])
    assert main(["bench", "refit", "--devices=-1,-1", "--scale", "0.001", "--cycles", "1", "--scenarios", "peak"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and f"{name}='" in captured.err, captured


def test_doctor_names_every_bad_variable_and_fails():
    from warmlink import _env

    assert sorted(_BAD_VARIABLES) == sorted(_env.VARIABLES)  # one bad value for every variable there is
    done = _warmlink(["doctor"], **_BAD_VARIABLES, WARMLINK_TIMOUT_S="5")  # and a misspelled name
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == len(_BAD_VARIABLES) + 1, done.stderr
    for name in (*_BAD_VARIABLES, "WARMLINK_TIMOUT_S"):
        assert sum(line.startswith(f"warmlink doctor: {name}=") for line in lines) == 1, (name, done.stderr)
        assert f"{name}=" in done.stdout and "INVALID" in done.stdout
    assert "is not a warmlink variable" in done.stderr
    assert "too-short" not in done.stdout + done.stderr  # a secret's value is never shown
