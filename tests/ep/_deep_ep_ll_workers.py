"""Rank-side scenarios of the ``deep_ep`` low-latency tests: DeepEP's low-latency calls through
``warmlink.ep.deep_ep`` over a gloo group (tensors on the CPU, or with ``case["cuda"]`` on the
GPU), returning what ``_ll_workers.ll_rounds``
returns so that the same oracle checks them (``test_low_latency.check_rounds``)."""

from __future__ import annotations

import torch

import warmlink.ep.deep_ep as deep_ep
from tests.ep._deep_ep_workers import first_call_outcome, gloo_group, ranks_of, routed
from tests.ep._ll_workers import _dispatch, _received, dequantized, expert_output, ll_inputs


def _attempt(report: dict, name: str, call) -> None:
    try:
        call()
        report[name] = "ok"
    except Exception as exc:  # noqa: BLE001 - the test compares the type and message
        report[name] = f"{type(exc).__name__}: {exc}"


def _normal_round(buffer, case: dict, rank: int, num_ranks: int) -> bool:
    """A normal-mode dispatch and combine on the same ``deep_ep.Buffer``: each token comes back
    summed once per rank it went to (as ``_deep_ep_workers.run_snippet`` checks)."""
    normal = {"tokens": 12, "hidden": case["hidden"], "experts": case["experts"], "topk": 2, "seed": 9}
    x, idx, probs = routed(normal, rank)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, case["experts"])
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=probs, num_tokens_per_rank=per_rank,
                                                      is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    combined = buffer.combine(recv_x, handle, topk_weights=recv_w)[0]
    where = ranks_of(idx, case["experts"], num_ranks)
    return torch.equal(combined, (x.float() * where.sum(1, keepdim=True)).to(torch.bfloat16))


def deep_ep_ll_rounds(rank: int, num_ranks: int, store, case: dict) -> dict:
    """DeepEP's test sequence through ``deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes,
    low_latency_mode=True, ...)`` sized by its hint (with ``case["deep_eps_hint"]``, called as DeepEP's
    callers call it, naming no top-k): a clean before anything is built, then one
    dispatch + combine per ``case["calls"]`` (with a normal-mode round after the first when
    ``num_nvl_bytes``), then calls of other shapes (each refused), and a round that still works.
    Returns ``{"rounds": [ll_rounds' entries], "report": {call: "ok" or the error}}``."""
    dev = "cuda" if case.get("cuda") else "cpu"  # on a GPU the low-latency Buffer runs its device path
    if case.get("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mine = {k: v.to(dev) for k, v in ll_inputs(case)[rank].items()}
    tokens, hidden, experts, topk = max(case["tokens"]), case["hidden"], case["experts"], case["topk"]
    local = experts // num_ranks
    rounds, report = [], {}
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        num_rdma_bytes = (deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts)
                          if case.get("deep_eps_hint")  # as DeepEP's callers size it: no top-k named
                          else deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts,
                                                                             num_topk=topk))
        buffer = deep_ep.Buffer(group, case.get("num_nvl_bytes", 0), num_rdma_bytes, low_latency_mode=True,
                                num_qps_per_rank=local, explicitly_destroy=True, timeout_s=30)
        buffer.clean_low_latency_buffer(tokens, hidden, experts)  # nothing built yet: nothing to clean
        report["built_by_clean"] = buffer.warmlink_low_latency_buffer is not None
        for i, call in enumerate(case["calls"]):
            stats = torch.zeros(local, dtype=torch.int32, device=dev)
            recv_x, count, handle, event, _ = _dispatch(buffer, mine, case, call, stats)
            report.setdefault("events", set()).add(type(event).__name__)
            got = _received(recv_x, count, handle, stats)
            y = expert_output(dequantized(got["recv_x"], hidden), rank, local).to(dev)
            delay = call.get("hook_delay_s")
            combined, event, hook = buffer.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], handle,
                                                               return_recv_hook=delay is not None,
                                                               async_finish=delay is None)
            hook() if delay is not None else event.current_stream_wait()
            got["combined"] = combined.to("cpu", copy=True)
            rounds.append(got)
            if i == 0 and case.get("num_nvl_bytes"):
                report["normal_round"] = _normal_round(buffer, case, rank, num_ranks)
            if i == 0:
                buffer.clean_low_latency_buffer(tokens, hidden, experts)
        inner = buffer.warmlink_low_latency_buffer
        report["built"] = {"max_tokens": inner.layout.max_tokens, "hidden": inner.layout.hidden,
                           "num_topk": inner.layout.num_topk, "num_rdma_bytes": num_rdma_bytes}
        x, idx = mine["x"], mine["topk_idx"]
        _attempt(report, "other_tokens", lambda: buffer.low_latency_dispatch(x, idx, tokens + 1, experts))
        _attempt(report, "other_hidden", lambda: buffer.low_latency_dispatch(torch.cat([x, x], 1), idx, tokens, experts))
        _attempt(report, "other_experts", lambda: buffer.low_latency_dispatch(x, idx, tokens, 2 * experts))
        _attempt(report, "wider_topk", lambda: buffer.low_latency_dispatch(x, torch.cat([idx, idx[:, :1]], 1), tokens,
                                                                           experts))
        _attempt(report, "other_clean", lambda: buffer.clean_low_latency_buffer(tokens, hidden + 128, experts))
        _attempt(report, "next_combine_buffer", lambda: buffer.get_next_low_latency_combine_buffer(handle))
        if not case.get("num_nvl_bytes"):
            _attempt(report, "normal_dispatch", lambda: _normal_round(buffer, case, rank, num_ranks))
        _attempt(report, "round_after", lambda: _dispatch(buffer, mine, case, case["calls"][0], None))
        buffer.destroy()
        _attempt(report, "after_destroy", lambda: _dispatch(buffer, mine, case, case["calls"][0], None))
    report["events"] = sorted(report.get("events", ()))
    return {"rounds": rounds, "report": report}


def deep_ep_ll_shrink(rank: int, num_ranks: int, store, case: dict) -> dict:
    """DeepEP's ``--shrink-test`` flow on ``deep_ep.Buffer(..., enable_shrink=True)``: a BF16
    dispatch + combine on every rank; then rank ``case["fails"]`` dispatches but stops before its
    combine (alive, calling nothing, as DeepEP's failing rank), and the others' combine masks it
    at its deadline; they query the mask, clean, query again and run a round without it. Returns
    each round's outputs (``_ll_workers.ll_shrink``'s) with the mask after it, and the queries."""
    mine = ll_inputs(case)[rank]
    tokens, hidden, experts = max(case["tokens"]), case["hidden"], case["experts"]
    local, status = experts // num_ranks, torch.zeros(num_ranks, dtype=torch.int32)
    rounds, report = [], {}
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        size = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts, num_topk=case["topk"])
        buffer = deep_ep.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=local, explicitly_destroy=True,
                                enable_shrink=True, timeout_s=case["timeout_s"])

        def one(fails: bool = False) -> dict | None:
            stats = torch.zeros(local, dtype=torch.int32)
            recv_x, count, handle, _, _ = buffer.low_latency_dispatch(
                mine["x"], mine["topk_idx"], tokens, experts, cumulative_local_expert_recv_stats=stats, use_fp8=False)
            if fails and rank == case["fails"]:
                return None
            got = _received(recv_x, count, handle, stats)
            y = expert_output(got["recv_x"], rank, local)
            got["combined"] = buffer.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], handle)[0].clone()
            buffer.low_latency_query_mask_buffer(status)
            got["mask"] = status.tolist()
            return got

        rounds.append(one())
        second = one(fails=True)
        if second is not None:
            rounds.append(second)
            buffer.clean_low_latency_buffer(tokens, hidden, experts)
            buffer.low_latency_query_mask_buffer(status)
            report["mask_after_clean"] = status.tolist()
            rounds.append(one())
        group.barrier()  # the failed rank stays until the others are done, as DeepEP's test's does
        buffer.destroy()
    return {"rounds": rounds, "report": report}


def deep_ep_ll_gone_before_first_call(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Every rank builds ``deep_ep.Buffer(group, 0, hint, low_latency_mode=True)``; rank 1 then
    makes no call (alive, as DeepEP's shrink test fails a rank) until rank 0 is done, and rank 0's
    first dispatch, which builds the low-latency Buffer, must end within its timeout
    (``first_call_outcome``)."""
    mine = ll_inputs(case)[rank]
    tokens, hidden, experts = max(case["tokens"]), case["hidden"], case["experts"]
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        size = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts, num_topk=case["topk"])
        buffer = deep_ep.Buffer(group, 0, size, low_latency_mode=True, explicitly_destroy=True,
                                enable_shrink=case.get("shrink", False), timeout_s=case["timeout_s"])
        if rank == 1:
            store.get("gone-test/done", timeout_s=60)
            return {}
        return first_call_outcome(store, buffer, lambda: buffer.low_latency_dispatch(
            mine["x"], mine["topk_idx"], tokens, experts, use_fp8=False))
