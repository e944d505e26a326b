"""ep's low-latency mode over shm in spawned rank processes, checked against a global oracle
(modelled on DeepEP's tests/legacy/test_low_latency.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.ep._group import run_ranks
from tests.ep._ll_workers import (RANK_OFFSET, decode_scales, dequantized, expert_output, ll_fault, ll_inputs, ll_rounds,
                                  ll_shrink)
from warmlink.errors import ConfigError

_LOW32 = (1 << 32) - 1


def reference_routes(case: dict) -> list[list[list[tuple[int, int, int]]]]:
    """``routes[d][e]``: the ``(source rank, token, top-k column)`` of every row expert ``e`` of rank
    ``d`` receives, ordered by source rank, then token (plain loops: obviously right)."""
    inputs = ll_inputs(case)
    num_ranks = len(inputs)
    local = case["experts"] // num_ranks
    routes = [[[] for _ in range(local)] for _ in range(num_ranks)]
    for s, mine in enumerate(inputs):
        for t, row in enumerate(mine["topk_idx"].tolist()):
            for k, g in enumerate(row):
                if g >= 0:
                    routes[g // local][g % local].append((s, t, k))
    for per_rank in routes:
        for rows in per_rank:
            rows.sort()
    return routes


def check_dispatch(case: dict, call: dict, got: list[dict], routes) -> None:
    """Counts, ranges, source info and rows of one dispatch on every rank against the oracle."""
    inputs, hidden = ll_inputs(case), case["hidden"]
    for d, g in enumerate(got):
        fp8 = isinstance(g["recv_x"], tuple)
        # BF16 rows arrive as sent; DeepEP's pattern also survives the FP8 cast, but not rounded scales
        exact = not fp8 or (not call.get("round_scale") and not case.get("random_x"))
        assert g["handle_sizes"] == [case.get("call_tokens", max(case["tokens"])), hidden, case["experts"]]
        deq = dequantized(g["recv_x"], hidden)
        for e, rows in enumerate(routes[d]):
            n = len(rows)
            assert g["count"][e].item() == n and g["stats"][e].item() == n, (d, e, g["count"], n)
            assert g["src_info"][e, :n].tolist() == [t for _, t, _ in rows], (d, e)
            begin = 0
            for s in range(len(inputs)):
                c = sum(1 for src, _, _ in rows if src == s)
                packed = g["layout_range"][e, s].item()
                assert (packed >> 32, packed & _LOW32) == (begin, c), (d, e, s)
                begin += c
            want = torch.stack([inputs[s]["x"][t] for s, t, _ in rows]) if rows else torch.empty(0, hidden)
            if exact:
                assert torch.equal(deq[e, :n], want.to(torch.bfloat16)), (d, e)
            if exact and not case.get("random_x"):  # every row names its source: rank, then token in the last 128
                assert all((deq[e, j, :-128] == s - RANK_OFFSET).all() and (deq[e, j, -128:] == t).all()
                           for j, (s, t, _) in enumerate(rows))
            if not exact and n:  # FP8 e4m3 keeps 3 mantissa bits: within 1/16 of the value, or a subnormal step of the scale
                scales = decode_scales(g["recv_x"][1], hidden)[e, :n]
                step = scales.repeat_interleave(128, dim=1) * 2.0**-9
                assert ((deq[e, :n].float() - want.float()).abs() <= want.float().abs() / 16 + step).all(), (d, e)
            if fp8 and call.get("round_scale"):
                scales = decode_scales(g["recv_x"][1], hidden)[e, :n]
                assert torch.equal(torch.exp2(torch.log2(scales).round()), scales), "scales are not powers of two"


def check_combine(case: dict, got: list[dict], routes) -> None:
    """Each token's combined row against the oracle's weighted sum of the rows its experts sent back."""
    inputs, num_ranks = ll_inputs(case), len(got)
    local = case["experts"] // num_ranks
    sent_back = [expert_output(dequantized(g["recv_x"], case["hidden"]), d, local) for d, g in enumerate(got)]
    for s, mine in enumerate(inputs):
        want = torch.zeros(len(mine["x"]), case["hidden"], dtype=torch.float64)
        for d in range(num_ranks):
            for e, rows in enumerate(routes[d]):
                for j, (src, t, k) in enumerate(rows):
                    if src == s:
                        want[t] += mine["topk_weights"][t, k].double() * sent_back[d][e, j].double()
        combined = got[s]["combined"]
        assert combined.dtype == torch.bfloat16 and combined.shape == want.shape
        assert torch.allclose(combined.double(), want, rtol=2**-7, atol=1e-6), f"rank {s}: combined_x differs"
        masked = (mine["topk_idx"] < 0).all(dim=1)
        assert (combined[masked] == 0).all(), "a token with no expert must combine to zeros"


def check_rounds(case: dict, results: list[list[dict]]) -> None:
    routes = reference_routes(case)
    calls = case["calls"] * case.get("repeat", 1)
    for i, call in enumerate(calls):
        got = [r[i] for r in results]
        check_dispatch(case, call, got, routes)
        check_combine(case, got, routes)


CASES = {
    "2 ranks, bf16 and fp8, hook with out, zero-copy combines of both parities": {
        "tokens": [32, 24], "hidden": 512, "experts": 16, "topk": 4, "masked": 10, "seed": 1,
        "calls": [{"fp8": False, "zero_copy": True}, {"fp8": True, "zero_copy": True, "hook_delay_s": 0.0},
                  {"fp8": True, "hook_delay_s": 0.01, "out": True}]},
    "4 ranks, top-8 of 32, a rank with no tokens, fewer tokens than the buffer holds": {
        "tokens": [64, 1, 0, 40], "hidden": 1024, "experts": 32, "topk": 8, "masked": 10, "seed": 2,
        "max_tokens": 96, "call_tokens": 64, "num_topk": 9,
        "calls": [{"fp8": True, "round_scale": True}, {"fp8": True, "round_scale": True, "ue8m0": True,
                                                       "hook_delay_s": 0.02}, {"fp8": False, "hook_delay_s": 0.0}]},
    "3 ranks, random tokens within FP8 tolerance, UE8M0 with a padded word": {
        "tokens": [40, 33, 20], "hidden": 768, "experts": 12, "topk": 3, "masked": 5, "seed": 3, "random_x": True,
        "calls": [{"fp8": True}, {"fp8": True, "round_scale": True, "ue8m0": True}, {"fp8": False}]},
}


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_and_combine_match_the_reference(name):
    case = CASES[name]
    check_rounds(case, run_ranks(ll_rounds, len(case["tokens"]), case=case, timeout_s=120))


def test_twenty_reruns_are_identical():
    case = {"tokens": [32, 29], "hidden": 256, "experts": 16, "topk": 4, "masked": 6, "seed": 4, "repeat": 20,
            "calls": [{"fp8": True, "hook_delay_s": 0.0}]}
    check_identical_reruns(case, run_ranks(ll_rounds, 2, case=case, timeout_s=120))


def check_identical_reruns(case: dict, results: list[list[dict]]) -> None:
    """Every round right, and every rerun bit for bit the first one."""
    check_rounds(case, results)
    for rounds in results:
        for got in rounds[1:]:
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(got["recv_x"], rounds[0]["recv_x"], strict=True))
            assert torch.equal(got["combined"], rounds[0]["combined"])


_PEER_CASE = {"tokens": [8, 8, 8], "hidden": 256, "experts": 6, "topk": 2, "timeout_s": 10.0}


def test_a_peer_dead_before_the_round_raises_peer_lost_within_the_timeout():
    errors = run_ranks(ll_fault, 3, case=dict(_PEER_CASE, fault="dies_before_dispatch"), timeout_s=90)
    assert errors[1] == "exited"
    for r in (0, 2):
        assert errors[r]["dispatch"].startswith("PeerLostError") and "rank 1" in errors[r]["dispatch"], errors[r]
        assert errors[r]["dispatch_s"] < _PEER_CASE["timeout_s"]


def test_a_peer_killed_mid_round_raises_peer_lost_and_the_buffer_stays_refused():
    errors = run_ranks(ll_fault, 3, case=dict(_PEER_CASE, fault="dies_between_dispatch_and_combine"), timeout_s=90)
    for r in (0, 2):
        report = errors[r]
        assert report["dispatch"] == "ok", report  # its rows were sent before it died
        assert report["combine"].startswith("PeerLostError") and "rank 1" in report["combine"], report
        assert report["combine_s"] < _PEER_CASE["timeout_s"]
        assert report["after"].startswith("PeerLostError") and "out of step" in report["after"], report


def check_masked_round(case: dict, got: dict, routes, sources_out: set, experts_out: set) -> None:
    """One round of the survivors ``got`` (``{rank: outputs}``): rows from ``sources_out`` absent
    from the dispatch, rows of experts on ``experts_out`` absent from each token's sum, and the
    mask naming ``experts_out``."""
    num_ranks, hidden = len(case["tokens"]), case["hidden"]
    local = case["experts"] // num_ranks
    inputs = ll_inputs(case)
    for d, g in got.items():
        assert g["mask"] == [int(r in experts_out) for r in range(num_ranks)], (d, g["mask"])
        for e, rows in enumerate(routes[d]):
            rows = [row for row in rows if row[0] not in sources_out]
            n = len(rows)
            assert g["count"][e].item() == n and g["stats"][e].item() == n, (d, e)
            assert g["src_info"][e, :n].tolist() == [t for _, t, _ in rows], (d, e)
            want = torch.stack([inputs[s]["x"][t] for s, t, _ in rows]) if rows else torch.empty(0, hidden)
            assert torch.equal(g["recv_x"][e, :n], want.to(torch.bfloat16)), (d, e)
            for s in sources_out:
                assert g["layout_range"][e, s].item() & _LOW32 == 0, (d, e, s)
    for s, g in got.items():  # expert_output's scale of each row, from the oracle (a dead rank returns nothing)
        want = torch.zeros(len(inputs[s]["x"]), hidden, dtype=torch.float64)
        for t, row in enumerate(inputs[s]["topk_idx"].tolist()):
            for k, expert in enumerate(row):
                if expert >= 0 and expert // local not in experts_out:
                    want[t] += inputs[s]["topk_weights"][t, k].double() * inputs[s]["x"][t].double() * 2.0 ** (expert % 3)
        bad = ~torch.isclose(g["combined"].double(), want, rtol=2**-7, atol=1e-6)
        assert not bad.any(), (f"rank {s}: combined_x differs at {bad.sum().item()} elements, first (token, column) "
                               f"{bad.nonzero()[0].tolist()}: {g['combined'][bad][0].item()} where "
                               f"{want[bad][0].item():.4f}")


SHRINK_CASE = {"tokens": [16, 12, 14], "hidden": 256, "experts": 6, "topk": 3, "masked": 4, "seed": 8, "dies": 2,
               "timeout_s": 3.0}


def check_shrink(case: dict, results: list) -> None:
    """ll_shrink's rounds: all ranks; the dead rank's rows arrived but its combine did not; then
    without it (before and after a clean)."""
    dead = case["dies"]
    assert results[dead] == ("stayed" if case.get("stays") else "exited")
    routes = reference_routes(case)
    survivors = {r: rounds for r, rounds in enumerate(results) if r != dead}
    for i, (sources_out, experts_out) in enumerate([(set(), set()), (set(), {dead}), ({dead}, {dead}),
                                                    ({dead}, {dead})]):
        try:
            check_masked_round(case, {r: rounds[i] for r, rounds in survivors.items()}, routes, sources_out,
                               experts_out)
        except AssertionError as exc:  # which round: the first, the one the rank stopped in, or after
            raise AssertionError(f"round {i + 1} of 4: {exc}") from None


def test_with_enable_shrink_a_rank_killed_mid_call_is_masked_and_the_others_go_on_without_its_rows():
    """DeepEP's mask buffer over shm: a rank exits between its dispatch and its combine; the
    others' combine masks it (a dead peer is seen at once, not after the timeout), and later
    rounds, a clean and the round after it run among the survivors, against the oracle."""
    check_shrink(SHRINK_CASE, run_ranks(ll_shrink, 3, case=SHRINK_CASE, timeout_s=120))


def test_a_stalled_peer_raises_transfer_timeout_after_the_timeout_naming_it():
    case = {"tokens": [6, 6], "hidden": 256, "experts": 4, "topk": 2, "fault": "stalled_peer", "timeout_s": 1.0}
    report = run_ranks(ll_fault, 2, case=case, timeout_s=90)[0]
    assert report["dispatch"].startswith("TransferTimeout") and "ranks [1]" in report["dispatch"], report
    assert 1.0 <= report["dispatch_s"] < 2.5, report
    assert report["after"].startswith("TransferTimeout") and "out of step" in report["after"], report


def test_ranks_calling_with_different_arguments_all_refuse_and_the_next_round_works():
    case = {"tokens": [12, 7], "hidden": 256, "experts": 4, "topk": 2, "seed": 5, "fault": "fp8_differs"}
    results = run_ranks(ll_fault, 2, case=case)
    routes = reference_routes(case)
    for d, report in enumerate(results):
        assert report["dispatch"].startswith("ConfigError") and "use_fp8=False" in report["dispatch"], report
    for d, report in enumerate(results):
        deq = dequantized(report["recv_x"], case["hidden"])
        for e, rows in enumerate(routes[d]):
            assert all((deq[e, j, :-128] == s - RANK_OFFSET).all() and (deq[e, j, -128:] == t).all()
                       for j, (s, t, _) in enumerate(rows)), (d, e)


def _counts(routes, d):
    return torch.tensor([len(rows) for rows in routes[d]], dtype=torch.int32)


def test_ranks_combining_different_dispatches_all_refuse():
    case = {"tokens": [6, 6], "hidden": 256, "experts": 4, "topk": 2, "fault": "combines_differ", "timeout_s": 10.0}
    for report in run_ranks(ll_fault, 2, case=case):
        assert report["combine"].startswith("ConfigError") and "handle of dispatch round" in report["combine"], report


def test_clean_zeroes_the_outputs_and_refuses_older_handles():
    case = {"tokens": [10, 5], "hidden": 256, "experts": 4, "topk": 2, "seed": 6, "fault": "clean"}
    routes = reference_routes(case)
    for d, report in enumerate(run_ranks(ll_fault, 2, case=case)):
        assert report["zeroed"], report
        assert report["old_handle"].startswith("ConfigError") and "predates clean_low_latency_buffer" in report["old_handle"]
        assert torch.equal(report["count"], _counts(routes, d))


# -- one rank, in this process: every argument is checked before any byte moves ------------------
@contextlib.contextmanager
def _one_rank_buffer(prefix: str):
    """``(Buffer, store)`` of a one-rank low-latency group: 8 tokens x 256, top-2 of 4 experts."""
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    store = Store(is_server=True, prefix=prefix, timeout_s=10)
    try:
        with Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=256, num_topk=2, backend="shm", timeout_s=5,
                    low_latency_mode=True, num_experts=4) as buf:
            yield buf, store
    finally:
        store.close()


@pytest.fixture
def one_rank():
    with _one_rank_buffer("ep-ll-args") as (buf, _):
        yield buf


def _routing():
    x = torch.arange(4 * 256, dtype=torch.float32).view(4, 256).remainder(7).to(torch.bfloat16)
    return x, torch.tensor([[0, 1], [2, -1], [3, 0], [-1, -1]]), torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.5, 0.5], [1.0, 1.0]])


def test_bad_dispatch_arguments_are_refused_naming_the_argument(one_rank):
    x, idx, _ = _routing()
    bad = [({"x": torch.cat([x, x, x])}, "x has 12 tokens; expected at most num_max_dispatch_tokens_per_rank=8"),
           ({"x": x.float()}, "x.dtype=torch.float32"),
           ({"x": x[:, :128]}, "x has 128 channels; the Buffer was built for hidden=256"),
           ({"topk_idx": idx.to(torch.int16)}, "topk_idx.dtype=torch.int16"),
           ({"topk_idx": idx[:3]}, r"topk_idx.shape=\(3, 2\); expected \[4, K\]"),
           ({"topk_idx": idx + 3}, r"entries in \[2, 6\]; expected every entry in \[-1, 4\)"),
           ({"num_experts": 6}, "num_experts=6; this Buffer was built for num_experts=4"),
           ({"num_max_dispatch_tokens_per_rank": 9}, r"num_max_dispatch_tokens_per_rank=9; expected an int in \[1, 8\]"),
           ({"use_ue8m0": True}, "use_ue8m0=True needs round_scale=True"),
           ({"use_fp8": False, "round_scale": True}, "round_scale=True with use_fp8=False"),
           ({"use_fp8": 1}, "use_fp8=1; expected a bool"),
           ({"cumulative_local_expert_recv_stats": torch.zeros(4, dtype=torch.int64)},
            "cumulative_local_expert_recv_stats.dtype=torch.int64"),
           ({"dispatch_wait_recv_cost_stats": torch.zeros(2, dtype=torch.int64)},
            r"dispatch_wait_recv_cost_stats.shape=\(2,\); expected \(1,\)")]
    for change, match in bad:
        args = {"x": x, "topk_idx": idx, "num_max_dispatch_tokens_per_rank": 8, "num_experts": 4, **change}
        with pytest.raises(ConfigError, match=match):
            one_rank.low_latency_dispatch(**args)
    # nothing moved and no round was spent: a valid call now is round 1, and its rows are right
    recv_x, count, handle, _, _ = one_rank.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    assert handle.round == 1 and count.tolist() == [2, 1, 1, 1]
    assert torch.equal(recv_x[0, :2], x[[0, 2]]) and torch.equal(recv_x[3, :1], x[[2]])


def test_bad_combine_arguments_and_handles_are_refused(one_rank):
    x, idx, w = _routing()
    recv_x, count, handle, _, _ = one_rank.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    y = recv_x.clone()
    unmasked = idx.clone()
    unmasked[1, 1] = 1
    bad = [({"use_logfmt": True}, "use_logfmt=True is not supported"),
           ({"x": y.float()}, "x.dtype=torch.float32"),
           ({"x": y[:, :4]}, r"x.shape=\(4, 4, 256\); expected \(4, 8, 256\)"),
           ({"topk_weights": w.double()}, "topk_weights.dtype=torch.float64"),
           ({"topk_idx": unmasked}, "selects experts where the dispatch's topk_idx held -1"),
           ({"out": torch.empty(3, 256, dtype=torch.bfloat16)}, r"out.shape=\(3, 256\)"),
           ({"handle": tuple(handle)}, "handle is a tuple"),
           ({"combine_wait_recv_cost_stats": torch.zeros(1, dtype=torch.int32)}, "combine_wait_recv_cost_stats.dtype"),
           ({"zero_copy": True}, "zero_copy=True, but get_next_low_latency_combine_buffer was never called")]
    for change, match in bad:
        args = {"x": y, "topk_idx": idx, "topk_weights": w, "handle": handle, **change}
        with pytest.raises(ConfigError, match=match):
            one_rank.low_latency_combine(**args)
    with pytest.raises(ConfigError, match="get_next_low_latency_combine_buffer: handle is a tuple"):
        one_rank.get_next_low_latency_combine_buffer(tuple(handle))
    masked = idx.clone()
    masked[0, 1] = -1  # masking more entries than the dispatch did is allowed: they are skipped
    costs = torch.zeros(1, dtype=torch.int64)
    one_rank.get_next_low_latency_combine_buffer(handle).copy_(y)  # read instead of x: zero_copy
    combined, _, hook = one_rank.low_latency_combine(torch.zeros_like(y), masked, w, handle, zero_copy=True,
                                                     combine_wait_recv_cost_stats=costs)
    keep = (masked >= 0).float() * w
    assert hook is None and costs.item() >= 0
    assert torch.allclose(combined.float(), (keep.sum(1, keepdim=True) * x.float()).to(torch.bfloat16).float())
    for _ in range(2):  # two dispatches later the first handle's outputs are reused
        one_rank.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    with pytest.raises(ConfigError, match="its outputs were reused by dispatch round 3"):
        one_rank.low_latency_combine(y, idx, w, handle)
    other = _one_rank_buffer("ep-ll-other")
    with other as (buf, _):
        mine = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        with pytest.raises(ConfigError, match="comes from another Buffer"):
            one_rank.low_latency_combine(mine[0].clone(), idx, w, mine[2])


def test_two_dispatches_may_await_their_hooks_a_third_is_refused_and_no_mode_no_calls(one_rank):
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    x, idx, w = _routing()
    first = one_rank.low_latency_dispatch(x, idx, 8, 4, return_recv_hook=True)
    second = one_rank.low_latency_dispatch(-x, idx, 8, 4, use_fp8=False, return_recv_hook=True)
    with pytest.raises(ConfigError, match=r"hooks of low-latency dispatch rounds \[1, 2\] were not called"):
        one_rank.low_latency_dispatch(x, idx, 8, 4)
    with pytest.raises(ConfigError, match="call its hook first"):
        one_rank.low_latency_combine(second[0], idx, w, second[2])
    second[4]()  # hooks may come out of order
    with pytest.raises(ConfigError, match=r"rounds \[1\] were not called"):
        one_rank.low_latency_dispatch(x, idx, 8, 4)
    first[4]()
    first[4]()  # a second call of a hook does nothing
    assert first[1].tolist() == [2, 1, 1, 1] and torch.equal(second[0][0, :2], -x[[0, 2]])
    assert one_rank.low_latency_dispatch(x, idx, 8, 4)[2].round == 3
    store = Store(is_server=True, prefix="ep-ll-plain", timeout_s=10)
    try:
        with Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=256, num_topk=2, backend="shm") as plain:
            with pytest.raises(ConfigError, match="built without low_latency_mode=True"):
                plain.low_latency_dispatch(x, idx, 8, 4)
        with pytest.raises(ConfigError, match="num_experts=4 without low_latency_mode=True"):
            Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=256, num_topk=2, backend="shm", num_experts=4)
    finally:
        store.close()


def test_size_hint_counts_the_region_outputs_and_combine_buffers_and_refuses_bad_sizes():
    from warmlink.ep import Buffer

    # 128 tokens x 7168, top-8 of 256 experts on 8 ranks: region 2 x (E*T*(2H + 8) + 8E + T*K*2H +
    # 8(2R + E)), each area a multiple of 256 bytes (the last, 2176 bytes, takes 2304)
    region = 2 * (256 * 128 * (2 * 7168 + 8) + 8 * 256 + 128 * 8 * 2 * 7168 + 2304)
    outputs = 2 * (256 * 128 * (2 * 7168 + 4 * 56 + 4 * 14 + 12) + 256 * 8 + 32 * 4 + 128 * 8)
    combine_buffers = 2 * 256 * 128 * 2 * 7168  # the zero-copy combine's, 2 x E*T*2H
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == region + outputs + combine_buffers
    for args, match in (((128, 7168, 8, 250), "num_experts=250; expected a multiple of num_ranks=8"),
                        ((128, 7000, 8, 256), "hidden=7000; expected a multiple of 128"),
                        ((0, 7168, 8, 256), "max_tokens=0")):
        with pytest.raises(ConfigError, match=match):
            Buffer.get_low_latency_rdma_size_hint(*args)


def test_a_gpu_buffer_without_triton_or_another_backend_is_refused_before_it_leases_anything(monkeypatch):
    """ep.Buffer calls this check before its resources connect: a Buffer whose low-latency mode
    cannot run is refused without opening any peer's memory first."""
    from types import SimpleNamespace

    from warmlink.ep.low_latency import LowLatencyMethods

    with pytest.raises(ConfigError, match="backend='nixl'; expected 'shm' or 'cuda_ipc'"):
        LowLatencyMethods._check_low_latency(SimpleNamespace(backend="nixl"), True, 16)
    with pytest.raises(ConfigError, match="needs num_experts"):
        LowLatencyMethods._check_low_latency(SimpleNamespace(backend="shm"), True, None)
    LowLatencyMethods._check_low_latency(SimpleNamespace(backend="shm"), True, 16)  # takes it
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(ConfigError, match="on a GPU needs Triton"):
        LowLatencyMethods._check_low_latency(SimpleNamespace(backend="cuda_ipc"), True, 16)


def test_rounds_after_the_first_and_later_lifecycles_create_nothing_and_waits_are_counted():
    from tests.ep._ll_workers import ll_warm

    case = {"tokens": [8, 8], "hidden": 256, "experts": 4, "topk": 2, "lifecycles": 4}
    for out in run_ranks(ll_warm, 2, case=case, timeout_s=120):
        assert out["rounds"][1] == {} and out["rounds"][2] == {}, out["rounds"]
        assert all(c == {} for c in out["lifecycles"][1:]), out["lifecycles"]
        for phase, costs in out["costs"].items():  # nanoseconds until each source's round was seen, summed
            assert (costs > 0).all(), (phase, costs)


def test_two_micro_batches_in_flight_match_the_reference():
    """A decode step's overlap: send A, send B, A's hook while B's rows travel, A's combine, B's hook..."""
    from tests.ep._ll_workers import ll_two_batches

    case = {"tokens": [24, 17, 30], "hidden": 256, "experts": 12, "topk": 4, "masked": 4, "seeds": [7, 8],
            "calls": [{"fp8": True}]}
    results = run_ranks(ll_two_batches, 3, case=case, timeout_s=120)
    for i, seed in enumerate(case["seeds"]):
        check_rounds(dict(case, seed=seed), [[r[i]] for r in results])


def test_low_latency_buffer_from_a_torch_distributed_group():
    import socket

    from tests.ep._ll_workers import ll_from_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    case = {"tokens": [9, 14], "hidden": 256, "experts": 8, "topk": 3, "seed": 21, "dist_port": port,
            "calls": [{"fp8": True}]}
    check_rounds(case, run_ranks(ll_from_group, 2, case=case))
