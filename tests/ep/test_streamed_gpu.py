"""ep.Buffer(send="stream") over cuda_ipc: the streamed dispatch and combine (ep.protocol.streamed)
against the oracle, its refusals, and a stalled peer mid-stream. On one GPU two ranks share it
(tests.ep._workers.rank_device): every step runs, at no link speed."""

from __future__ import annotations

import pytest
import torch

from tests.ep._group import run_ranks
from tests.ep._reference import reference_dispatch
from tests.ep._streamed_workers import graph_replays, merged_combine, stalled_peer_then_clear, unposted_outputs
from tests.ep._workers import case_inputs, changing_rounds, dispatch_combine, expect_error
from tests.ep.test_buffer import changing_case, check_against_reference, check_changing_rounds

pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RANKS = min(max(_GPUS, 2), 8)


def _tokens(*counts):
    return [counts[r % len(counts)] for r in range(RANKS)]


_STREAM = {"backend": "cuda_ipc", "send": "stream", "rounds": 2, "timeout_s": 60.0}
CASES = {
    # rings of 8 rows on 4 channels: every ring wraps many times a call
    "bf16 uneven, masked, small rings, cached": {"tokens": _tokens(300, 0, 77, 512), "hidden": 1024, "experts": 32,
                                                 "topk": 8, "mask_prob": 0.1, "cached": True, "cached_repeats": 3,
                                                 "stream_channels": 4, "ring_rows": 8, "seed": 31},
    "fp8": {"tokens": _tokens(256, 129), "hidden": 2048, "experts": 16, "topk": 4, "dtype": torch.float8_e4m3fn,
            "cached": True, "seed": 32},
    "deepseek hidden, cached": {"tokens": _tokens(1024, 640), "hidden": 7168, "experts": 64, "topk": 8, "cached": True,
                                "seed": 33},
    "padded outputs, cached, events": {"tokens": _tokens(200, 77), "hidden": 1024, "experts": 16, "topk": 4,
                                       "cached": True, "num_worst_tokens": RANKS * 200, "async_finish": True,
                                       "stream_channels": 3, "ring_rows": 16, "seed": 34},
}


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_streamed_dispatch_combine_match_the_reference(name):
    case = dict(CASES[name], **_STREAM)
    check_against_reference(case, run_ranks(dispatch_combine, RANKS, case=case, timeout_s=300))


@pytest.mark.parametrize("name,merge", [("bf16 uneven, masked, small rings, cached", 3), ("deepseek hidden, cached", 2),
                                        ("padded outputs, cached, events", 2)])
def test_gpu_a_combine_whose_programs_take_merged_channels_matches_the_reference(name, merge):
    """The CUDA combine's programs each taking ``merge`` adjacent dispatch channels (stream.cu's Merged
    channels, from three ranks on at 20 channels; here forced): spans of uneven width (4 channels by
    3), merged rings wrapping, and the next round's dispatch on channels whose heads only the
    combine's FIN freed."""
    case = dict(CASES[name], **_STREAM, merge=merge)
    check_against_reference(case, run_ranks(merged_combine, RANKS, case=case, timeout_s=300))


@pytest.mark.parametrize("name", ["bf16 uneven, masked, small rings, cached", "padded outputs, cached, events"])
def test_gpu_streamed_calls_on_the_triton_kernels_match_the_reference(name, monkeypatch):
    """The same Buffer on the Triton streamed kernels (``WARMLINK_EP_STREAM_KERNEL=triton``, and past
    the CUDA kernels' 8 ranks): its fresh dispatch reads a copy of the starts, not the CUDA launch's."""
    monkeypatch.setenv("WARMLINK_EP_STREAM_KERNEL", "triton")
    case = dict(CASES[name], **_STREAM)
    check_against_reference(case, run_ranks(dispatch_combine, RANKS, case=case, timeout_s=300))


@pytest.mark.parametrize("name", ["bf16 uneven, masked, small rings, cached", "fp8"])
def test_gpu_streamed_calls_with_the_python_host_steps_match_the_reference(name, monkeypatch):
    """``WARMLINK_EP_HOST=python`` (as where no C++ compiler is): the layout's launch and the fresh
    dispatch's steps from the board to its launch run in Python, not ep.kernels.host's compiled ones."""
    monkeypatch.setenv("WARMLINK_EP_HOST", "python")
    case = dict(CASES[name], **_STREAM)
    check_against_reference(case, run_ranks(dispatch_combine, RANKS, case=case, timeout_s=300))


def test_gpu_planned_fresh_dispatches_read_each_calls_new_inputs():
    """From the third fresh dispatch of a kind of call on, its steps up to the board run as one
    compiled call from the kind's plan (ep.paths.planned, Note [Planned fresh dispatch]): BF16,
    FP8, then BF16 again, with get_dispatch_layout's outputs, new tensors and token counts every
    call (no call's addresses may come from the plan's first), each equal to the oracle; the two
    kinds with weights were planned (the last call, without weights, is a third kind, unplanned)."""
    case = dict(changing_case(RANKS, backend="cuda_ipc"), send="stream", layout=True, timeout_s=60.0)
    results = run_ranks(changing_rounds, RANKS, case=case, timeout_s=180)
    check_changing_rounds(case, results)
    assert [r["plans"] for r in results] == [2] * RANKS


@pytest.mark.parametrize("name", ["padded outputs, cached, events", "fp8"])
def test_gpu_planned_calls_of_four_rounds_match_the_reference(name):
    """Four rounds of a case: from the third on its fresh dispatches are planned (ep.paths.planned),
    a padded one whole in one compiled call (on the communication stream: async_finish), an FP8
    one up to the board."""
    case = {**CASES[name], **_STREAM, "rounds": 4}
    check_against_reference(case, run_ranks(dispatch_combine, RANKS, case=case, timeout_s=300))


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_gpu_a_refused_input_spends_the_streamed_round_and_the_next_one_works(padded):
    """Rank 0 dispatches an expert id out of range: the count exchange refuses the round on every
    rank, every rank's stream sends nothing (their seq counts stay in step), rank 0 raises ConfigError
    saying what was wrong and every other rank RefusedRound naming it (a padded one at its next call),
    and the next dispatch is right."""
    case = dict(_STREAM, tokens=_tokens(6, 9), hidden=256, experts=2 * RANKS, topk=2, fault="refused_then_valid",
                refusal="bad_expert", worst=RANKS * 9 if padded else 0, seed=35)
    results = run_ranks(expect_error, RANKS, case=case, timeout_s=300)
    for rank, (first, _, padded_ids) in enumerate(results):
        assert ("ConfigError" if rank == 0 else "RefusedRound: ep.Buffer.dispatch: ranks [0]") in first, first
        assert "drain" not in first, first
        assert first.startswith("returned, then ") == padded, first
        if padded:
            assert bool((padded_ids == -1).all()), padded_ids
    inputs = case_inputs(case)
    ref = reference_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs], None, case["experts"])
    for d, (_, recv_x, _) in enumerate(results):
        assert torch.equal(recv_x, ref[d]["recv_x"]), f"rank {d}: the dispatch after the refused one differs"


def test_gpu_a_stalled_peer_mid_stream_raises_within_the_timeout_and_the_next_call_works():
    timeout_s = 2.0
    case = dict(_STREAM, tokens=_tokens(512, 300), hidden=1024, experts=16, topk=4, timeout_s=timeout_s,
                stall_s=1.5 * timeout_s, stream_channels=4, ring_rows=8, seed=36)
    results = run_ranks(stalled_peer_then_clear, RANKS, case=case, timeout_s=300)
    for rank, got in enumerate(results):
        assert got["first"].startswith("TransferTimeout"), (rank, got)
        assert got["same_x"] and got["same_y"], (rank, got)
    for got in results[:1]:  # the ranks that did not stall: an error within the deadline (and the host's slack)
        assert got["first_s"] < timeout_s + 1.5, got


def test_gpu_a_captured_padded_dispatch_cached_dispatch_and_combine_replay_like_eager_calls():
    """ep.protocol.streamed, Note [Streamed calls]: the seq and round counts live on the device, so a
    graph of streamed calls replays calls of their own, with eager calls between replays; every
    replay's outputs equal the same calls made eagerly, for inputs written into the captured tensors."""
    case = dict(_STREAM, tokens=_tokens(300, 77), hidden=1024, experts=16, topk=4, stream_channels=4, ring_rows=16,
                seeds=[41, 42, 43])
    for rank, per_seed in enumerate(run_ranks(graph_replays, RANKS, case=case, timeout_s=300)):
        for got in per_seed:
            assert got["received"] > 0 and all(got["same"].values()), (rank, got)


@pytest.mark.parametrize("unposted", ["void", "never"])
def test_gpu_a_planned_call_whose_host_fails_before_posting_its_outputs_fails_alone(unposted):
    """Note [Posted outputs]: a planned fresh dispatch's stream is launched with its exchange and
    waits for the outputs its host posts. Rank 0's host fails after that launch ("void": its
    outputs' allocation fails in the compiled post, which posts void; "never": nothing is posted).
    Void: rank 0's call raises at once, its stream takes the peers' rows and stores none, so every
    other rank's call is right and the next calls are right everywhere. Never: rank 0's receivers
    wait out the deadline, its peers' senders too (their rings to rank 0 stay full), each rank's
    next call raises TransferTimeout and clears the space, and the call after is right."""
    timeout_s = 2.0
    case = dict(_STREAM, tokens=_tokens(512, 300), hidden=1024, experts=16, topk=4, timeout_s=timeout_s,
                stream_channels=4, ring_rows=8, seed=37, unposted=unposted)
    results = run_ranks(unposted_outputs, RANKS, case=case, timeout_s=300)
    for rank, got in enumerate(results):
        assert got["plans"] == 1, (rank, got)
        first, second, third = got["calls"]
        if unposted == "void":
            assert first.startswith("RuntimeError") if rank == 0 else first == "same", (rank, got)
            assert (second, third) == ("same", "same"), (rank, got)
        else:
            # (a peer's rows all reached it: its senders to rank 0 failed, maybe not its receivers)
            assert first.startswith("MemoryError: injected") if rank == 0 else first in ("same", "differs"), (rank, got)
            assert second.startswith("TransferTimeout"), (rank, got)
            assert third == "same", (rank, got)
