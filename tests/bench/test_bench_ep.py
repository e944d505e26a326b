"""``warmlink bench ep`` end to end on CPU ranks over shm: tables, records, checks."""

from __future__ import annotations

import json
import random

import pytest

from warmlink.cli.main import main

SMALL = ["--ranks", "2", "--tokens", "48", "--hidden", "256", "--experts", "8", "--topk", "4", "--timeout", "120"]


def test_bench_ep_prints_every_operation_and_checks_outputs(tmp_path, capsys):
    out = tmp_path / "ep.json"
    assert main(["bench", "ep", *SMALL, "--iterations", "2", "--warmup", "1", "--gemm", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("warmlink dispatch bf16", "warmlink dispatch fp8 hook", "warmlink dispatch cached", "warmlink combine bf16",
                "torch+NCCL dispatch (bf16)", "NCCL all_to_all_single, same bytes"):
        assert row in text
    record = json.loads(out.read_text())
    assert all(record["summary"]["checks"].values()), record["summary"]["checks"]
    assert record["ranks"][0]["bytes"]["bf16"] == record["ranks"][0]["cross_rows"] * 256 * 2
    # DeepEP's count: every received row, a rank's own included; rows are conserved across ranks
    ranks = record["ranks"]
    assert sum(r["recv_rows"] for r in ranks) >= sum(r["cross_rows"] for r in ranks)
    row = record["summary"]["warmlink dispatch bf16"]
    received = min(r["recv_rows"] for r in ranks) * 256 * 2
    assert abs(row["gb_s_deepep_count"] / row["gb_s"] - received / min(r["bytes"]["bf16"] for r in ranks)) < 1e-9
    # the host time until each call returns, idle and with rank 0's peer late (no queued work on CPU)
    calls = {"fresh", "fresh_padded", "cached", "combine"}
    summary = record["summary"]
    assert set(summary["returns_ms"]) == set(summary["returns_late_ms"]) == calls and "returns_busy_ms" not in summary
    assert "host time until the call returns, every peer of rank 0 ~1 ms late" in text


def test_bench_ep_lifecycles_reuse_everything_with_the_pool_on(tmp_path, capsys):
    out = tmp_path / "life.json"
    assert main(["bench", "ep", *SMALL, "--lifecycles", "4", "--json", str(out)]) == 0
    assert "Buffer create" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert not any(record["summary"]["pool_on"]["created"].values()), record["summary"]["pool_on"]["created"]
    assert record["summary"]["pool_off"]["created"].get("arena", 0) >= 1
    for rank in record["pool_on"]:
        assert all(not row["created"] for row in rank[1:]), rank


def test_bench_ep_runs_a_hidden_size_that_is_not_a_multiple_of_128(tmp_path, capsys):
    """gpt-oss's 2880 channels, scaled down: FP8 with a partial last block of scales, checked against NCCL."""
    out = tmp_path / "ep.json"
    args = [a if a != "256" else "200" for a in SMALL]
    assert main(["bench", "ep", *args, "--iterations", "2", "--warmup", "1", "--gemm", "0", "--json", str(out)]) == 0
    assert "warmlink dispatch fp8" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["summary"]["checks"]["dispatch_fp8"] and all(record["summary"]["checks"].values())
    rank = record["ranks"][0]
    assert rank["bytes"]["fp8"] == rank["cross_rows"] * (200 + 2 * 4)  # 200 FP8 channels and 2 float32 scales


def test_bench_ep_times_the_deep_ep_drop_in_with_both_budgets(tmp_path, capsys):
    out = tmp_path / "ep.json"
    assert main(["bench", "ep", *SMALL, "--iterations", "2", "--warmup", "1", "--gemm", "0", "--deep-ep",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("deep_ep fresh bf16, hint budget", "deep_ep fresh fp8, hint budget", "deep_ep padded bf16, hint budget",
                "deep_ep cached bf16, 2e9 budget (1 round)", "deep_ep cached fp8, 2e9 budget (1 round)",
                "deep_ep combine bf16, hint budget"):
        assert row in text
    assert "DeepEP V1 beside" not in text  # no DeepEP here (it needs CUDA): nothing pretends to be it
    record = json.loads(out.read_text())
    from warmlink.bench.ep_deep_ep import CALLS

    for rank in record["ranks"]:
        assert rank["deep_ep_s"]["large"]["rounds"] == 1 and rank["deep_ep_s"]["hint"]["rounds"] >= 1
        assert rank["deep_ep_s"]["large"]["budget"] == int(2e9)
        for budget in ("hint", "large"):
            for call in CALLS:
                clocks = rank["deep_ep_s"][budget][call]
                assert clocks["host"] > 0 and clocks["events"] is None  # no CUDA events on the CPU
        assert "overlap" not in rank["deep_ep_s"]["large"]  # a GPU row: the GEMM beside an async combine
        assert "deepep_v1_s" not in rank
    # the tables of GPU ranks that measured them: the slowest rank's figures, and their ratios
    from warmlink.bench.ep_table import table

    for i, rank in enumerate(record["ranks"]):
        rank["deep_ep_s"]["large"]["overlap"] = {
            k: {"host": v, "events": None} for k, v in (("gemm", 1e-3), ("combine", 4e-4 + i * 1e-4),
                                                        ("combine_then_gemm", 1.4e-3), ("gemm_beside", 1.05e-3 + i * 1e-4))}
        rank["deepep_v1_s"] = {b: {c: {"host": 3e-4 * (1 + i), "events": 2e-4 * (1 + i)} for c in CALLS}
                               for b in ("hint", "large")}
        for b in ("hint", "large"):
            for c in CALLS:
                rank["deep_ep_s"][b][c] = {"host": 1e-4 * (1 + i), "events": 4e-4 * (1 + i)}
    lines, summary = table(record["config"], record["ranks"])
    overlap = summary["deep_ep_overlap"]
    assert (overlap["combine_ms"], overlap["beside_ms"]) == pytest.approx((0.5, 1.15))
    assert overlap["ratio"] == pytest.approx(1.15 / 1.4)
    assert any(line.startswith("deep_ep, GEMM queued before an async combine") and line.endswith("= 0.82 x") for line in lines)
    beside = summary["deepep_v1"]["fresh_fp8/hint"]
    assert beside["host"]["ratio"] == pytest.approx(3.0) and beside["events"]["ratio"] == pytest.approx(0.5)
    assert beside["host"]["deepep_us"] == pytest.approx(300 * len(record["ranks"]))  # the slowest rank's
    assert any(line.startswith("fresh_fp8     hint") and line.endswith("3.00x") for line in lines)


def test_bench_ep_shuffle_times_the_dispatch_rows_in_the_seeds_order_on_every_rank(tmp_path, capsys):
    out = tmp_path / "shuffled.json"
    assert main(["bench", "ep", *SMALL, "--iterations", "1", "--warmup", "0", "--gemm", "0", "--shuffle", "3",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    plain = ["dispatch_bf16", "dispatch_bf16_eager", "dispatch_bf16_hook", "dispatch_bf16_copy", "dispatch_fp8",
             "dispatch_fp8_hook", "dispatch_cached", "dispatch_cached_eager", "dispatch_cached_copy",
             "dispatch_bf16_stream", "dispatch_fp8_stream", "dispatch_cached_stream"]
    expected = list(plain)
    random.Random(3).shuffle(expected)
    assert expected != plain
    for rank in record["ranks"]:
        assert rank["dispatch_order"] == expected and set(plain) <= set(rank["times_s"])
    assert all(record["summary"]["checks"].values()) and "warmlink dispatch fp8 hook" in capsys.readouterr().out


def test_the_codes_beside_each_other_are_timed_call_by_call_in_turn():
    """With DeepEP importable the bench times both codes (``time_deep_ep`` of two modules): here
    the drop-in twice, on CPU ranks. Every call of both has its clocks, per budget, and the samples
    of one call alternate between the codes, the first rotating each iteration, so that a host
    whose speed drifts during the run moves both alike."""
    from tests.ep._deep_ep_workers import codes_in_turn, free_port
    from tests.ep._group import run_ranks
    from warmlink.bench.ep_deep_ep import BUDGETS, CALLS

    case = {"tokens": 24, "experts": 8, "topk": 2, "hidden": 128, "dist_port": free_port()}
    for got in run_ranks(codes_in_turn, 2, case=case, timeout_s=240):
        assert len(got["timed"]) == 2
        for code in got["timed"]:
            for budget in BUDGETS:
                assert code[budget]["rounds"] >= 1 and all(code[budget][c]["host"] > 0 for c in CALLS)
        # per call kind and budget: 1 warm-up and 2 timed iterations, each running both codes
        assert got["order"] == [0, 1, 1, 0, 0, 1] * len(CALLS) * len(BUDGETS)
