"""``warmlink.ep.deep_ep``'s low-latency calls as DeepEP code makes them
(``Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, ...)``, DeepEP's
tests/legacy/test_low_latency.py): in spawned ranks over a gloo group, checked against the same
oracle as ``ep.Buffer``'s own low-latency calls; in one process, the budget and the refusals."""

from __future__ import annotations

import re

import pytest
import torch

import warmlink.ep.deep_ep as deep_ep
from tests.ep._deep_ep_ll_workers import deep_ep_ll_gone_before_first_call, deep_ep_ll_rounds, deep_ep_ll_shrink
from tests.ep._deep_ep_workers import free_port
from tests.ep._group import run_ranks
from tests.ep.test_low_latency import check_masked_round, check_rounds, reference_routes
from warmlink.ep import Buffer as EPBuffer
from warmlink.ep import size_hint
from warmlink.errors import ConfigError


class _Group:
    """What the constructor reads of a process group: no collective can run on it, so a call that
    got as far as building a warmlink Buffer would fail with another error."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


CASES = {
    "low-latency only, bf16, fp8 and UE8M0, hooks and events": {
        "tokens": [16, 11], "hidden": 256, "experts": 8, "topk": 3, "masked": 4, "seed": 21,
        "calls": [{"fp8": False}, {"fp8": True, "hook_delay_s": 0.0},
                  {"fp8": True, "round_scale": True, "ue8m0": True}]},
    "both modes in one Buffer": {
        "tokens": [9, 14], "hidden": 256, "experts": 4, "topk": 2, "masked": 3, "seed": 22, "num_nvl_bytes": 1 << 22,
        "calls": [{"fp8": True}, {"fp8": False, "hook_delay_s": 0.0}]},
    "top-9, in a budget sized as DeepEP's callers size it": {
        "tokens": [8, 12], "hidden": 256, "experts": 18, "topk": 9, "masked": 5, "seed": 23, "deep_eps_hint": True,
        "calls": [{"fp8": True}, {"fp8": False}]},
}


@pytest.mark.parametrize("name", list(CASES))
def test_deep_ep_low_latency_calls_match_the_reference_and_other_shapes_are_refused(name):
    _check_deep_ep_low_latency(dict(CASES[name], dist_port=free_port()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_deep_ep_low_latency_calls_run_the_device_path_and_match_the_reference():
    """The same sequence with every tensor on the GPU (ranks sharing it): the low-latency Buffer
    that the first call builds runs the device path (ep.low_latency._device)."""
    _check_deep_ep_low_latency(dict(CASES["low-latency only, bf16, fp8 and UE8M0, hooks and events"],
                                    dist_port=free_port(), cuda=True))


def _check_deep_ep_low_latency(case: dict) -> None:
    results = run_ranks(deep_ep_ll_rounds, 2, case=case, timeout_s=120)
    check_rounds(case, [r["rounds"] for r in results])
    tokens, hidden, experts = max(case["tokens"]), case["hidden"], case["experts"]
    for r in results:
        report = r["report"]
        assert report["built_by_clean"] is False and report["events"] == ["EventOverlap"], report
        assert report["built"] == {"max_tokens": tokens, "hidden": hidden, "num_topk": case["topk"],
                                   "num_rdma_bytes": EPBuffer.get_low_latency_rdma_size_hint(
                                       tokens, hidden, 2, experts, num_topk=case["topk"])
                                   + size_hint(tokens, hidden, num_ranks=2, num_topk=case["topk"])}, report
        built = (f"built by its first call for num_max_dispatch_tokens_per_rank={tokens}, hidden={hidden}, "
                 f"num_experts={experts} and at most {case['topk']} top-k columns")
        for call, asked in (("other_tokens", f"num_max_dispatch_tokens_per_rank={tokens + 1}, hidden={hidden}"),
                            ("other_hidden", f"hidden={2 * hidden}, num_experts={experts}"),
                            ("other_experts", f"num_experts={2 * experts} and"),
                            ("wider_topk", f"and {case['topk'] + 1} top-k columns"),
                            ("other_clean", f"hidden={hidden + 128}, num_experts={experts};")):
            assert report[call].startswith("ConfigError: deep_ep.Buffer.") and asked in report[call], (call, report)
            assert built in report[call], (call, report[call])
        assert report["next_combine_buffer"] == "ok", report
        if case.get("num_nvl_bytes"):
            assert report["normal_round"] is True, report
        else:
            assert report["normal_dispatch"].startswith("ConfigError") and "num_nvl_bytes=0" in report["normal_dispatch"]
        assert report["round_after"] == "ok", report
        assert report["after_destroy"] == "ConfigError: deep_ep.Buffer.low_latency_dispatch: the buffer was destroyed"


def test_deep_eps_shrink_flow_masks_a_rank_that_stops_calling_and_the_others_go_on():
    """DeepEP's test_low_latency.py --shrink-test, at 3 ranks (its own needs 6: it fails ranks 1, 3
    and 5): rank 1 dispatches, then calls nothing; the others' combine masks it when its deadline
    passes, the mask stays through a clean, and a round without it is right (the oracle)."""
    case = {"tokens": [12, 9, 10], "hidden": 256, "experts": 6, "topk": 3, "masked": 3, "seed": 11, "fails": 1,
            "timeout_s": 2.0, "dist_port": free_port()}
    results = run_ranks(deep_ep_ll_shrink, 3, case=case, timeout_s=120)
    assert len(results[1]["rounds"]) == 1  # the failed rank's first round only
    routes = reference_routes(case)
    survivors = {r: results[r] for r in (0, 2)}
    for i, (sources_out, experts_out) in enumerate([(set(), set()), (set(), {1}), ({1}, {1})]):
        check_masked_round(case, {r: out["rounds"][i] for r, out in survivors.items()}, routes, sources_out,
                           experts_out)
    assert all(out["report"]["mask_after_clean"] == [0, 1, 0] for out in survivors.values())


def test_a_rank_gone_before_its_first_call_costs_the_others_a_timeout_not_a_hang():
    """The low-latency Buffer is built by the first call; its ranks meet over the store the
    constructor made, so a rank that makes no call (as DeepEP's shrink test fails one, here with
    enable_shrink) is named within the timeout instead of blocking its peers in a collective of
    the group (before, rank 0 waited in the group's all_gather)."""
    case = {"tokens": [6, 6], "hidden": 256, "experts": 4, "topk": 2, "timeout_s": 2.0, "shrink": True,
            "dist_port": free_port()}
    got = run_ranks(deep_ep_ll_gone_before_first_call, 2, case=case, timeout_s=60)[0]
    assert got["error"] is not None and got["error"].startswith(("TransferTimeout", "PeerLostError")), got
    assert re.search(r"key='ep(-ll)?/\d+/1'", got["error"]) and got["seconds"] < 15, got  # rank 1's rendezvous key


def test_a_shape_the_budget_cannot_hold_is_refused_naming_both_before_anything_is_built():
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(64, 7168, 2, 16)  # DeepEP's call: its widest top-k, 9
    assert hint == EPBuffer.get_low_latency_rdma_size_hint(64, 7168, 2, 16, num_topk=9) + size_hint(
        64, 7168, num_ranks=2, num_topk=9)
    top8 = deep_ep.Buffer.get_low_latency_rdma_size_hint(64, 7168, 2, 16, num_topk=8)
    assert top8 < hint
    buffer = deep_ep.Buffer(_Group(2), 0, top8 - 1, low_latency_mode=True, num_qps_per_rank=8)
    x = torch.zeros(64, 7168, dtype=torch.bfloat16)
    idx = torch.zeros(64, 8, dtype=deep_ep.topk_idx_t)
    with pytest.raises(ConfigError, match=f"need {top8} bytes .*num_rdma_bytes={top8 - 1} .*cannot hold them"):
        buffer.low_latency_dispatch(x, idx, 64, 16)
    wider = deep_ep.Buffer.get_low_latency_rdma_size_hint(64, 7168, 2, 16, num_topk=10)
    assert wider > hint
    with pytest.raises(ConfigError, match=f"10 top-k columns on 2 ranks need {wider} bytes .*num_topk=10"):
        deep_ep.Buffer(_Group(2), 0, hint, low_latency_mode=True).low_latency_dispatch(
            x, torch.zeros(64, 10, dtype=deep_ep.topk_idx_t), 64, 16)
    assert buffer.warmlink_low_latency_buffer is None and buffer.warmlink_buffer is None
    with pytest.raises(ConfigError, match="no low_latency_dispatch on this Buffer yet"):
        buffer.low_latency_combine(x, idx, torch.zeros(64, 8), None)


def test_the_mask_buffer_before_the_first_call_keeps_the_updates_and_refuses_bad_ones():
    """DeepEP's mask calls work from construction (its mask buffer exists then); before the first
    low_latency_dispatch builds warmlink's, they are kept and applied by it."""
    buffer = deep_ep.Buffer(_Group(4), 0, 1 << 20, low_latency_mode=True, enable_shrink=True)
    assert buffer.enable_shrink
    status = torch.full((4,), 7, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0, 0, 0]
    buffer.low_latency_update_mask_buffer(2, True)
    buffer.low_latency_update_mask_buffer(3, True)
    buffer.low_latency_update_mask_buffer(3)  # mask=False: DeepEP's default unmasks
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0, 1, 0]
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0, 0, 0]
    with pytest.raises(ConfigError, match=r"rank=4; expected an int in \[0, 4\)"):
        buffer.low_latency_update_mask_buffer(4, True)
    with pytest.raises(ConfigError, match="mask_status must be an int32 tensor of shape \\[4\\]"):
        buffer.low_latency_query_mask_buffer(torch.zeros(3, dtype=torch.int32))


def test_low_latency_arguments_and_what_is_not_here_are_refused_by_name():
    with pytest.raises(ConfigError, match="low_latency_mode=True with num_rdma_bytes=0"):
        deep_ep.Buffer(_Group(2), 0, 0, low_latency_mode=True)
    normal = deep_ep.Buffer(_Group(2), 1 << 20)
    with pytest.raises(ConfigError, match="made with low_latency_mode=False"):
        normal.low_latency_dispatch(torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int64), 2, 2)
    with pytest.raises(ConfigError, match="made with low_latency_mode=False"):
        normal.clean_low_latency_buffer(2, 128, 2)
    with pytest.raises(ConfigError, match="made with low_latency_mode=False"):  # the mode first, then the shapes
        normal.low_latency_dispatch(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64), 2, 2)
    # low-latency within one node may use more ranks than DeepEP's NVLink domain: num_rdma_bytes is its budget there
    assert deep_ep.Buffer(_Group(16), 0, 1 << 20, low_latency_mode=True).num_rdma_bytes == 1 << 20
    buffer = deep_ep.Buffer(_Group(2), 0, 1 << 20, low_latency_mode=True)
    for name in ("low_latency_update_mask_buffer", "low_latency_query_mask_buffer"):
        with pytest.raises(ConfigError, match=f"deep_ep.Buffer.{name}: this Buffer was made with enable_shrink=False"):
            getattr(buffer, name)(0)
    with pytest.raises(ConfigError, match="x and topk_idx must be 2-D tensors"):
        buffer.low_latency_dispatch(torch.zeros(128, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64), 2, 2)
