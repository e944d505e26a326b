"""``warmlink.ep.deep_ep``: DeepEP's API as DeepEP code calls it. In one process: arguments refused
by name, DeepEP's configs and size hints, events, and a batch the budget cannot hold refused with
the bytes it needs before anything is built. In spawned ranks over a gloo group: Megatron's
autograd dispatcher, outputs that later calls leave alone, combine's bias, and calls refused
after the Buffer is built."""

from __future__ import annotations

import re

import pytest
import torch

import warmlink.ep.deep_ep as deep_ep
from tests.ep._deep_ep_workers import (
    bias_and_refusals,
    captured_layer,
    free_port,
    gone_before_first_dispatch,
    megatron_steps,
    outputs_outlive_later_calls,
    packed_scales_arrive_bit_for_bit,
    padded_like_unpadded,
)
from tests.ep._group import run_ranks
from warmlink.ep.deep_ep.sizing import needed_bytes, tokens_within
from warmlink.errors import ConfigError


class _Group:
    """What the constructor reads of a process group (rank and size): no collective runs in these tests."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _hint(num_ranks: int, hidden_bytes: int) -> int:
    return max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
               for c in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)))


# -- one process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    ({"low_latency_mode": 1}, "low_latency_mode=1"), ({"enable_shrink": 1}, "enable_shrink=1"),
    ({"num_nvl_bytes": 0}, "num_nvl_bytes=0"), ({"num_nvl_bytes": -1}, "num_nvl_bytes=-1"),
    ({"comm": object()}, "comm=object"), ({"explicitly_destroy": 1}, "explicitly_destroy=1"),
    ({"use_fabric": "yes"}, "use_fabric='yes'"), ({"allow_mnnvl": None}, "allow_mnnvl=None")])
def test_what_the_buffer_cannot_do_is_refused_by_name(kwargs, field):
    args = {"num_nvl_bytes": 1 << 20, **kwargs}
    with pytest.raises(ConfigError, match=field):
        deep_ep.Buffer(_Group(2), **args)


def test_a_group_is_required_and_rdma_bytes_across_nodes_are_refused():
    with pytest.raises(ConfigError, match="group=None"):
        deep_ep.Buffer(None, 1 << 20)
    with pytest.raises(ConfigError, match="num_rdma_bytes=1024 with 16 ranks is DeepEP's internode mode"):
        deep_ep.Buffer(_Group(16), 1 << 20, 1024)
    within = deep_ep.Buffer(_Group(8), 1 << 20, 1024, num_qps_per_rank=1, allow_mnnvl=True, use_fabric=True)  # accepted, unused
    assert (within.group_size, within.num_nvl_bytes, within.num_rdma_bytes) == (8, 1 << 20, 1024)


def test_the_constructor_takes_deep_ep_v1s_arguments_in_its_order():
    """DeepEP V1's ``Buffer.__init__`` (9249c25): code that passes them positionally means the same here."""
    import inspect

    params = list(inspect.signature(deep_ep.Buffer.__init__).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                          "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                          "enable_shrink", "comm"]


@pytest.mark.parametrize("name,why", [("internode_dispatch", "one node"), ("get_local_buffer_tensor", "no ring buffer")])
def test_deep_ep_methods_that_are_not_here_raise_saying_why(name, why):
    buffer = deep_ep.Buffer(_Group(2), 1 << 20)
    with pytest.raises(ConfigError, match=f"deep_ep.Buffer.{name}: not supported; .*{why}"):
        getattr(buffer, name)(16, 7168, 2, 256)


def test_get_comm_stream_is_the_stream_async_calls_run_on_or_says_there_is_none():
    buffer = deep_ep.Buffer(_Group(2), 1 << 20, explicitly_destroy=True)
    try:
        if torch.cuda.is_available():  # leased once: every async_finish call runs on it
            stream = buffer.get_comm_stream()
            assert isinstance(stream, torch.cuda.Stream) and buffer.get_comm_stream() is stream
            assert stream != torch.cuda.current_stream()
        else:
            with pytest.raises(ConfigError, match="CUDA is not available; this Buffer's calls run on the host"):
                buffer.get_comm_stream()
    finally:
        buffer.destroy()


def test_size_hints_are_deep_eps():
    # DeepEP's own C++ (Config::get_nvl_buffer_size_hint at dd758ca) gives 335709824 bytes here, the
    # 0.31 GiB Megatron asks for at 8 ranks and hidden 7168; within one node the RDMA hint is 0
    config = deep_ep.Buffer.get_dispatch_config(8)
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) == 335709824
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0 and config.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    assert config.num_max_rdma_chunked_recv_tokens == 132  # rounded up to a multiple of the chunk, as DeepEP does
    # the hint grows with the token bytes and the peers, never shrinks
    assert _hint(2, 512) < _hint(2, 1024) < _hint(4, 1024) < _hint(8, 1024)


def test_configs_and_sm_counts_are_checked():
    with pytest.raises(ConfigError, match="num_ranks=3; expected one of"):
        deep_ep.Buffer.get_dispatch_config(3)
    with pytest.raises(ConfigError, match="num_max_nvl_chunked_send_tokens=8; expected fewer"):
        deep_ep.Config(20, 8, 8)
    with pytest.raises(ConfigError, match="new_num_sms=7"):
        deep_ep.Buffer.set_num_sms(7)
    before = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(24)
        assert deep_ep.Buffer.get_combine_config(4).num_sms == 24
    finally:
        deep_ep.Buffer.set_num_sms(before)


def test_events_as_deep_ep_code_uses_them():
    event = deep_ep.Buffer.capture()
    assert isinstance(event, deep_ep.utils.EventOverlap) and isinstance(event.event, deep_ep.utils.EventHandle)
    ran = []
    event.register_hook_after_wait(lambda: ran.append("hook"))
    with pytest.raises(ConfigError, match="a hook is registered already"):
        event.register_hook_after_wait(lambda: None)
    with event(release_handle=True):
        ran.append("work")
    assert ran == ["work", "hook"] and event.event is None
    with pytest.raises(ConfigError, match="without async_finish=True"):
        deep_ep.EventOverlap().current_stream_wait()


def test_layout_matches_the_routing_and_a_bad_previous_event_is_refused():
    buffer = deep_ep.Buffer(_Group(2), 1 << 20)
    idx = torch.tensor([[0, 3], [2, -1], [-1, -1]], dtype=deep_ep.topk_idx_t)
    per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(idx, 4, async_finish=True)
    assert per_rank.tolist() == [1, 2] and per_rdma_rank is None and per_expert.tolist() == [1, 0, 1, 1]
    assert in_rank.tolist() == [[True, True], [False, True], [False, False]]
    assert isinstance(event, deep_ep.EventOverlap)
    with pytest.raises(ConfigError, match="previous_event is a str"):
        buffer.get_dispatch_layout(idx, 4, previous_event="event")
    with pytest.raises(ConfigError, match="num_experts=3; expected a positive multiple of the group size 2"):
        buffer.get_dispatch_layout(idx, 3)


def test_a_budget_that_holds_not_one_token_is_refused_with_the_bytes_it_needs_before_anything_is_built():
    need = needed_bytes(1, 2, 7168, 8)
    buffer = deep_ep.Buffer(_Group(2), need - 1)
    x = torch.zeros(3, 7168, dtype=torch.bfloat16)
    idx = torch.zeros(3, 8, dtype=deep_ep.topk_idx_t)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 256)
    with pytest.raises(ConfigError, match=f"num_nvl_bytes={need - 1} .* holds not one token .* one needs {need} bytes"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx)
    assert repr(buffer).endswith("not built yet, inner=None)")
    assert tokens_within(need, 2, 7168, 8) == 1


def test_destroy_needs_explicitly_destroy_as_in_deep_ep():
    with pytest.raises(ConfigError, match="explicitly_destroy=False"):
        deep_ep.Buffer(_Group(2), 1 << 20).destroy()
    buffer = deep_ep.Buffer(_Group(2), 1 << 20, explicitly_destroy=True)
    buffer.destroy()
    with pytest.raises(ConfigError, match="destroyed"):
        buffer.get_dispatch_layout(torch.zeros(1, 2, dtype=torch.int64), 4)
    with deep_ep.Buffer(_Group(2), 1 << 20) as scoped:  # warmlink's close, whatever explicitly_destroy says
        assert scoped.warmlink_buffer is None  # built by the first dispatch only
    with pytest.raises(ConfigError, match="destroyed"):
        scoped.get_dispatch_layout(torch.zeros(1, 2, dtype=torch.int64), 4)


# -- spawned ranks -------------------------------------------------------------------------------
def test_megatrons_autograd_dispatcher_with_a_buffer_sized_from_the_hint():
    case = {"tokens": 40, "hidden": 256, "experts": 8, "topk": 2, "mask_prob": 0.1, "seed": 3, "dist_port": free_port()}
    results = run_ranks(megatron_steps, 2, case=case, timeout_s=180)
    assert all(len(steps) == 3 for steps in results), results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_megatrons_autograd_dispatcher_with_a_buffer_sized_from_the_hint():
    # a hint-sized budget at hidden 7168 and 2 ranks holds 576 tokens per rank (README, "DeepEP code, unchanged")
    case = {"tokens": 512, "hidden": 7168, "experts": 256, "topk": 8, "mask_prob": 0.05, "seed": 3, "cuda": True,
            "dist_port": free_port()}
    results = run_ranks(megatron_steps, 2, case=case, timeout_s=300)
    assert all(len(steps) == 3 for steps in results), results


def test_outputs_are_fresh_tensors_that_later_calls_leave_alone():
    case = {"tokens": 24, "hidden": 128, "experts": 4, "topk": 2, "seed": 5, "dist_port": free_port(),
            "num_nvl_bytes": _hint(2, 256)}
    for got in run_ranks(outputs_outlive_later_calls, 2, case=case, timeout_s=120):
        assert got["same"] and got["later_differ"] and got["rows"] > 0, got


def test_a_rank_gone_before_its_first_dispatch_costs_the_others_a_timeout_not_a_hang():
    """The first dispatch builds the warmlink Buffer; its ranks meet over the store the constructor
    made, so a rank that makes no call is named within the timeout (before, rank 0 waited in the
    group's all_gather, gloo's 30 minutes; on GPUs in an all_reduce, without end)."""
    case = {"tokens": 24, "hidden": 128, "experts": 4, "topk": 2, "seed": 5, "dist_port": free_port(),
            "num_nvl_bytes": _hint(2, 256), "timeout_s": 2.0}
    got = run_ranks(gone_before_first_dispatch, 2, case=case, timeout_s=60)[0]
    assert got["error"] is not None and got["error"].startswith(("TransferTimeout", "PeerLostError")), got
    assert re.search(r"key='ep/\d+/1'", got["error"]) and got["seconds"] < 15, got  # rank 1's rendezvous key


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])], ids=["shm", "gpu"])
def test_a_padded_dispatch_gives_the_handle_rows_and_combine_of_an_unpadded_one(cuda):
    """On a GPU the padded one returns at launch and its ``rank_prefix_matrix`` comes from the count
    board on the device (ep.protocol.normal, Note [Padded dispatch returns at launch])."""
    case = {"tokens": 48, "hidden": 256, "experts": 8, "topk": 2, "mask_prob": 0.1, "seed": 9, "cuda": cuda,
            "dist_port": free_port(), "num_nvl_bytes": 1 << 22}
    for got in run_ranks(padded_like_unpadded, 2, case=case, timeout_s=180):
        assert all(got.values()), got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_layer_captured_with_num_worst_tokens_replays_like_eager_calls():
    """DeepEP's budget hint at hidden 7168 holds 576 tokens per rank, so 1024 stream (the Buffer
    within keeps its seq and round counts on the device: ep.protocol.streamed, Note [Streamed
    calls]); each replay of the captured layout, padded fresh dispatch, cached dispatch and combine
    equals the same calls made eagerly, for new tokens and routing written into its inputs."""
    case = {"tokens": 1024, "hidden": 7168, "experts": 64, "topk": 4, "mask_prob": 0.05, "seeds": [21, 22, 23],
            "dist_port": free_port(), "num_nvl_bytes": _hint(2, 7168 * 2)}
    for rank, per_seed in enumerate(run_ranks(captured_layer, 2, case=case, timeout_s=300)):
        for got in per_seed:
            assert got["streamed"] and got["received"] > 0 and all(got["same"].values()), (rank, got)


def test_bias_is_added_larger_batches_go_in_rounds_and_bad_calls_are_refused_on_every_rank():
    case = {"tokens": 24, "hidden": 128, "experts": 4, "topk": 2, "seed": 7, "dist_port": free_port(),
            "num_nvl_bytes": 1 << 20}
    for got in run_ranks(bias_and_refusals, 2, case=case, timeout_s=120):
        assert got["one_bias"] and got["two_biases"], got
        assert got["more_than_held"] == "ok", got  # in rounds (tests/ep/test_deep_ep_rounds.py compares them)
        assert got["other_hidden"] == "ok", got  # a narrower hidden size is padded (tests/ep/test_deep_ep_widths.py)
        assert got["plain_tuple_handle"].startswith("ConfigError: deep_ep.Buffer.combine: handle is a tuple")
        assert got["bias_shape"].startswith("ConfigError") and "bias Tensor of shape (1, 128)" in got["bias_shape"]
        assert got["round_after"] == "ok"
        # built within the budget, as large as it holds
        assert got["built"] == {"max_tokens": got["held"], "nbytes": needed_bytes(got["held"], 2, 128, 2)}, got
        assert needed_bytes(got["held"], 2, 128, 2) <= case["num_nvl_bytes"] < needed_bytes(got["held"] + 1, 2, 128, 2)
        assert got["after_destroy"] == "ConfigError: deep_ep.Buffer.combine: the buffer was destroyed"


def test_fp8_with_ue8m0_scales_packed_in_int32_arrives_bit_for_bit():
    case = {"tokens": 30, "hidden": 2880, "experts": 4, "topk": 2, "seed": 11, "dist_port": free_port(),
            "num_nvl_bytes": 1 << 22}
    for got in run_ranks(packed_scales_arrive_bit_for_bit, 2, case=case, timeout_s=120):
        assert got["dtype"] == "torch.int32" and got["rows"] > 0 and got["fresh"] and got["cached"], got
