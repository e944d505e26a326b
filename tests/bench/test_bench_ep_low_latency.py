"""``warmlink bench ep --low-latency`` end to end: CPU ranks over shm, and GPU ranks (gpu-marked)."""

from __future__ import annotations

import json

import pytest

from warmlink.bench.ep_low_latency import DEEPEP_LOW_LATENCY
from warmlink.cli.main import main


def test_bench_ep_low_latency_prints_each_call_beside_deepeps_figures(tmp_path, capsys):
    out = tmp_path / "ll.json"
    args = ["bench", "ep", "--low-latency", "--ranks", "2", "--tokens", "16", "--hidden", "256", "--experts", "8",
            "--topk", "4", "--iterations", "3", "--warmup", "1", "--timeout", "120", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    for row in ("dispatch (fp8)", "combine (bf16)", "dispatch, hook mode: send", "combine, hook mode: hook",
                "dispatch + combine, eager", "DeepEP docs/legacy.md",
                "DeepEP V1 in this run: not run (its kernels need CUDA)"):
        assert row in text, row
    assert "     8             77     98            114    127" in text  # EP 8, as DeepEP publishes it
    assert "outputs checked against the routing (recv_count, combine): right" in text
    record = json.loads(out.read_text())
    assert record["wrong"] == [] and all(r["checks"] == {"warmlink": {"recv_count": True, "combine": True}}
                                         for r in record["ranks"])
    assert record["deepep_published"]["rows"] == [list(r) for r in DEEPEP_LOW_LATENCY]
    for rank in record["ranks"]:
        assert all(len(times) == 3 and min(times) > 0 for times in rank["times_s"].values()), rank
        pairs = [d + c for d, c in zip(rank["times_s"]["dispatch"], rank["times_s"]["combine"])]
        assert rank["times_s"]["pair"] == pairs
    for op, row in record["summary"].items():
        assert 0 < row["median_us"] <= row["p90_us"], (op, row)


@pytest.mark.parametrize(("ranks", "gpus", "says"), [
    (1, 1, "1 rank (1 GPU(s), cuda_ipc, CUDA events; one rank to itself: the kernels' own work, no link)"),
    (2, 1, "2 ranks (1 GPU(s), cuda_ipc, CUDA events; ranks share GPUs: kernels and protocol, not a link)"),
    (2, 2, "2 ranks (2 GPU(s), cuda_ipc, CUDA events),")])
def test_the_header_says_what_the_placement_of_the_ranks_measures(ranks, gpus, says):
    from warmlink.bench.ep_low_latency import _table

    cfg = {"device": "cuda", "gpus": gpus, "ranks": ranks, "tokens": 128, "hidden": 7168, "topk": 8, "experts": 256,
           "iterations": 2, "warmup": 1, "deepep": "not importable"}
    lines, summary = _table(cfg, [{"times_s": {"dispatch": [1e-5, 3e-5], "combine": [4e-5, 4e-5]}}] * ranks)
    assert says in lines[0]
    assert summary["dispatch"]["median_us"] == pytest.approx(20.0) and summary["combine"]["median_us"] == pytest.approx(40.0)


class _Miscounting:
    """A low-latency Buffer's two calls over one rank, with one expert's count one short (and its
    rows zeroed) or every combined row scaled: what the bench's check must catch."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def low_latency_dispatch(self, x, idx, tokens, experts, use_fp8=True):
        import torch

        count = torch.bincount(idx[idx >= 0].flatten(), minlength=experts).int()
        rows = torch.zeros(experts, tokens, x.shape[1], dtype=torch.float8_e4m3fn)
        if self.fault == "count":
            count[int(count.argmax())] -= 1
        return (rows, torch.ones(experts, tokens, x.shape[1] // 128)), count, None, None, None

    def low_latency_combine(self, y, idx, w, handle):
        return (0.5 if self.fault == "combine" else 1.0) * self.x * (w * (idx >= 0)).sum(1, keepdim=True), None, None


@pytest.mark.parametrize("fault", ["count", "combine"])
def test_the_output_check_catches_a_wrong_count_and_a_wrong_combine(fault):
    from warmlink.bench.ep_low_latency import _routing, check_outputs

    cfg = {"tokens": 16, "hidden": 256, "experts": 8, "topk": 4}
    x, idx, w = _routing(0, 16, 8, 4, 256)
    buf = _Miscounting(fault)
    buf.x = x.double()
    checked = check_outputs(buf, x, idx, w, 0, 1, cfg)
    assert checked == {"recv_count": fault != "count", "combine": fault != "combine"}


def test_the_phase_barrier_returns_on_no_rank_before_every_rank_called_it():
    import threading
    import time

    from warmlink.bench.ep_low_latency import _Barrier
    from warmlink.rendezvous import Store

    with Store(is_server=True, prefix="barrier-test", timeout_s=30) as server:
        clients = [Store.connect(server.address, prefix="barrier-test", timeout_s=30, secret=server.secret)
                   for _ in range(2)]
        barriers = [_Barrier(c, "warmlink", 2) for c in clients]
        called, passed = [[], []], [[], []]

        def rank(r: int) -> None:
            for i in range(3):
                if r == 1:
                    time.sleep(0.05)  # the late rank: the other waits for it every time
                called[r].append(time.monotonic())
                barriers[r]()
                passed[r].append(time.monotonic())

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
    assert len(passed[0]) == len(passed[1]) == 3
    for i in range(3):  # no rank left barrier i before both had called it
        assert min(passed[0][i], passed[1][i]) >= max(called[0][i], called[1][i])


def test_bench_ep_low_latency_refuses_experts_that_do_not_divide(capsys):
    assert main(["bench", "ep", "--low-latency", "--ranks", "3", "--experts", "8"]) != 0
    assert "--experts=8 is not a multiple of --ranks=3" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_bench_ep_low_latency_times_the_device_path(tmp_path, capsys):
    out = tmp_path / "ll.json"
    args = ["bench", "ep", "--low-latency", "--ranks", "2", "--tokens", "32", "--hidden", "1024", "--experts", "16",
            "--iterations", "5", "--warmup", "2", "--timeout", "120", "--json", str(out)]
    assert main(args) == 0
    assert "cuda_ipc, CUDA events" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["config"]["device"] == "cuda"
    assert {"dispatch_graph", "dispatch_send_graph", "dispatch_hook_graph", "combine_send_graph",
            "combine_hook_graph"} <= set(record["summary"])
    for op, row in record["summary"].items():
        assert 0 < row["median_us"] <= row["p90_us"], (op, row)
