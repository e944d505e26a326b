"""Low-latency mode's device path (ep.low_latency._device) on GPUs, rank r on GPU r % count (on one
GPU the ranks share it; on several the rows cross NVLink): the CPU tests' cases and oracle
(test_low_latency.py), CUDA graph replays, and failures raised by a later call."""

from __future__ import annotations

import pytest
import torch

from tests.ep._deep_ep_workers import free_port
from tests.ep._group import run_ranks
from tests.ep._ll_workers import (
    RANK_OFFSET,
    dequantized,
    ll_calls_keep_their_order,
    ll_device_fault,
    ll_graph,
    ll_rounds,
    ll_shrink,
    ll_two_batches,
)
from tests.ep.test_low_latency import (CASES, SHRINK_CASE, _counts, check_identical_reruns, check_rounds, check_shrink,
                                       reference_routes)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

_ON_GPU = {"backend": "cuda_ipc"}


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_dispatch_and_combine_match_the_reference(name):
    case = dict(CASES[name], **_ON_GPU)
    check_rounds(case, run_ranks(ll_rounds, len(case["tokens"]), case=case, timeout_s=300))


def test_gpu_deepeps_shape_with_more_local_experts_than_a_program_has_threads_matches_the_reference():
    """DeepEP's test shape (128 tokens x 7168, top-8 of 288: 144 experts per rank): the send's
    last program reads each destination's counts and zeroes them for the next round, threads
    splitting the two differently; without a barrier between them a rank received its later
    experts' rows with count 0 (seen across NVLink, where the signal stores are slow)."""
    case = {"tokens": [128, 128], "hidden": 7168, "experts": 288, "topk": 8, "masked": 10, "seed": 1,
            "calls": [{"fp8": False}, {"fp8": True}, {"fp8": False, "hook_delay_s": 0.0}], **_ON_GPU}
    check_rounds(case, run_ranks(ll_rounds, 2, case=case, timeout_s=300))


def test_gpu_twenty_reruns_are_identical_and_two_micro_batches_overlap():
    case = {"tokens": [32, 29], "hidden": 7168, "experts": 16, "topk": 4, "masked": 6, "seed": 4, "repeat": 20,
            "calls": [{"fp8": True, "hook_delay_s": 0.0}], **_ON_GPU}
    check_identical_reruns(case, run_ranks(ll_rounds, 2, case=case, timeout_s=300))
    case = {"tokens": [24, 17, 30], "hidden": 256, "experts": 12, "topk": 4, "masked": 4, "seeds": [7, 8],
            "calls": [{"fp8": True}], **_ON_GPU}
    results = run_ranks(ll_two_batches, 3, case=case, timeout_s=300)
    for i, seed in enumerate(case["seeds"]):
        check_rounds(dict(case, seed=seed), [[r[i]] for r in results])


@pytest.mark.parametrize("api", ["ep", "deep_ep"])
def test_gpu_a_call_on_the_callers_stream_runs_after_async_calls_still_queued(monkeypatch, api):
    """A low-latency dispatch on the caller's stream after an async one still queued on the
    communication stream runs after it: the third call (the first's parity) returns its own
    rows, not the first call's, released late over them; through ``ep.Buffer`` and through
    ``deep_ep.Buffer`` (whose own stream runs its async calls). More hardware queues than
    streams, so that the held stream does not hold the caller's through a shared queue."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    case = {"tokens": [16, 11], "hidden": 1024, "experts": 8, "topk": 3, "masked": 3, "seeds": [1, 2, 3], **_ON_GPU}
    if api == "deep_ep":
        case.update(deep_ep=True, dist_port=free_port())
    for out in run_ranks(ll_calls_keep_their_order, 2, case=case, timeout_s=300):
        held, unheld = out["held_last"], out["unheld_last"]
        assert torch.equal(held["count"], unheld["count"]) and int(unheld["count"].sum()) > 0
        for key in ("rows", "src_info"):
            assert all(torch.equal(a, b) for a, b in zip(held[key], unheld[key])), key


def test_gpu_a_captured_dispatch_and_combine_replay_with_each_replays_inputs():
    case = {"tokens": [16, 11], "hidden": 1024, "experts": 8, "topk": 3, "masked": 3, "seeds": [1, 2, 3, 4, 5],
            "calls": [{"fp8": False}], **_ON_GPU}
    results = run_ranks(ll_graph, 2, case=case, timeout_s=300)
    for i, seed in enumerate(case["seeds"]):
        check_rounds(dict(case, seed=seed), [[r[i]] for r in results])


def test_gpu_a_stalled_peer_is_raised_by_the_next_call_and_every_later_one():
    case = {"tokens": [6, 6], "hidden": 256, "experts": 4, "topk": 2, "fault": "stalled_peer", "timeout_s": 2.0,
            **_ON_GPU}
    report = run_ranks(ll_device_fault, 2, case=case, timeout_s=120)[0]
    assert report["dispatch"] == "ok", report  # the kernel's wait ended at its deadline; nothing raises inside a call
    assert report["after"].startswith("TransferTimeout") and "rank 1" in report["after"], report
    assert report["later"].startswith("TransferTimeout") and "out of step" in report["later"], report


def test_gpu_ranks_calling_with_different_arguments_all_refuse_once_then_rounds_go_on():
    case = {"tokens": [12, 7], "hidden": 256, "experts": 4, "topk": 2, "seed": 5, "fault": "fp8_differs", **_ON_GPU}
    results = run_ranks(ll_device_fault, 2, case=case, timeout_s=120)
    routes = reference_routes(case)
    for d, report in enumerate(results):
        assert report["dispatch"] == "ok", report
        assert report["after"].startswith("ConfigError") and "other arguments" in report["after"], report
        deq = dequantized(report["recv_x"], case["hidden"])
        for e, rows in enumerate(routes[d]):
            assert all((deq[e, j, :-128] == s - RANK_OFFSET).all() and (deq[e, j, -128:] == t).all()
                       for j, (s, t, _) in enumerate(rows)), (d, e)


def test_gpu_clean_zeroes_the_outputs_and_the_next_round_is_right():
    case = {"tokens": [10, 5], "hidden": 256, "experts": 4, "topk": 2, "seed": 6, "fault": "clean", **_ON_GPU}
    routes = reference_routes(case)
    for d, report in enumerate(run_ranks(ll_device_fault, 2, case=case, timeout_s=120)):
        assert report["zeroed"], report
        assert torch.equal(report["count"], _counts(routes, d))


def test_gpu_with_enable_shrink_a_rank_gone_mid_call_is_masked_and_the_others_go_on_without_its_rows():
    """The CPU test's scenario on the device path: the kernels' waits on the rank that stopped end
    at their deadline and mask it, and every later kernel neither waits for it nor writes into it.
    The rank stays alive, as DeepEP's test's failing rank does: its peers write into its region
    until they mask it, and a region exported through CUDA IPC by a process that exited is not
    promised to stay allocated."""
    case = dict(SHRINK_CASE, hidden=1024, stays=True, **_ON_GPU)
    check_shrink(case, run_ranks(ll_shrink, 3, case=case, timeout_s=200))
