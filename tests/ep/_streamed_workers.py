"""Rank-side scenarios of a streamed Buffer's failures (ep.protocol.streamed, Note [Streamed calls])."""

from __future__ import annotations

import time

import torch

from tests.ep._workers import _buffer, _cpu, _to, case_inputs, dispatch_combine, rank_device


def stalled_peer_then_clear(rank: int, num_ranks: int, store, case: dict) -> dict:
    """A warm-up Buffer compiles the kernels and closes; then, on a Buffer of a short timeout, every
    rank dispatches, and rank 1 stalls ``stall_s`` before its combine while the others combine at
    once: their combine ends at its deadline on the device, their next dispatch raises
    ``TransferTimeout`` and the one after clears the space with rank 1, whose late combine joins
    the clear and raises; then every rank's dispatch and combine equal the first ones."""
    mine = case_inputs(case)[rank]
    device = rank_device(rank, case)
    x, idx = _to(mine["x"], device), mine["topk_idx"].to(device)
    kw = {"topk_idx": idx, "num_experts": case["experts"]}
    with _buffer(rank, num_ranks, store, dict(case, timeout_s=60.0)) as buf:  # compiles every kernel
        out = buf.dispatch(x, **kw)
        buf.dispatch(x, handle=out[4])
        buf.combine(out[0].clone(), out[4])
        torch.cuda.synchronize(device)
    got: dict = {}
    with _buffer(rank, num_ranks, store, case) as buf:
        out = buf.dispatch(x, **kw)
        want_x = _cpu(out[0])
        want_y = _cpu(buf.combine(out[0].clone(), out[4])[0])
        torch.cuda.synchronize(device)
        out = buf.dispatch(x, **kw)
        if rank == 1:
            time.sleep(case["stall_s"])
        start = time.perf_counter()
        try:
            buf.combine(out[0].clone(), out[4])
            torch.cuda.synchronize(device)
            got["late combine"] = "ok"
            buf.dispatch(x, **kw)
            got["first"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test compares the type name
            got["first"] = f"{type(exc).__name__}: {exc}"
        got["first_s"] = time.perf_counter() - start
        out = buf.dispatch(x, **kw)
        got["same_x"] = torch.equal(_cpu(out[0]), want_x)
        got["same_y"] = torch.equal(_cpu(buf.combine(out[0].clone(), out[4])[0]), want_y)
        torch.cuda.synchronize(device)
    return got


def graph_replays(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """Every rank captures a padded fresh dispatch, a cached dispatch of its handle and a combine in
    one CUDA graph (after two eager rounds of the same calls, which compile the kernels), then, for
    each seed of ``case["seeds"]``, writes that seed's inputs and layout into the captured tensors,
    replays the graph, and makes the same calls eagerly: per seed, whether each output of the
    replay equals the eager one (the received rows; the padding's ids and weights whole)."""
    device = rank_device(rank, case)
    num_tokens, experts = case["tokens"][rank], case["experts"]
    worst = num_ranks * max(case["tokens"])

    def inputs(seed):
        mine = case_inputs(dict(case, seed=seed))[rank]
        return _to(mine["x"], device), mine["topk_idx"].to(device), mine["topk_weights"].to(device)

    results = []
    with _buffer(rank, num_ranks, store, case) as buf:
        x, idx, w = inputs(case["seeds"][0])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        static = {"x": x.clone(), "idx": idx.clone(), "w": w.clone(), "per_rank": per_rank.clone(),
                  "in_rank": in_rank.clone(), "per_expert": per_expert.clone()}

        def calls(t):
            recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
                t["x"], topk_idx=t["idx"], topk_weights=t["w"], num_tokens_per_rank=t["per_rank"],
                is_token_in_rank=t["in_rank"], num_tokens_per_expert=t["per_expert"], num_worst_tokens=worst)
            cached = buf.dispatch(t["x"], handle=handle)[0]
            combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            return (recv_x, recv_idx, recv_w, cached, combined, combined_w), handle

        for _ in range(2):
            calls(static)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = calls(static)
        for seed in case["seeds"]:
            x, idx, w = inputs(seed)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            for name, value in (("x", x), ("idx", idx), ("w", w), ("per_rank", per_rank), ("in_rank", in_rank),
                                ("per_expert", per_expert)):
                static[name].copy_(value)
            graph.replay()
            replayed = [_cpu(t) for t in captured]
            eager, handle = calls(static)
            eager = [_cpu(t) for t in eager]
            n = handle.num_recv_tokens
            same = {name: torch.equal(a[:n], b[:n]) if name in ("recv_x", "cached") else torch.equal(a, b)
                    for name, a, b in zip(("recv_x", "recv_idx", "recv_w", "cached", "combined", "combined_w"),
                                          replayed, eager)}
            results.append({"seed": seed, "received": n, "same": same})
        torch.cuda.synchronize(device)
    return results


def unposted_outputs(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Three fresh dispatches of one kind (the third is planned: its stream is launched with the
    exchange and waits for the outputs the host posts, Note [Posted outputs]), then one where rank
    0's host fails before it posts: ``case["unposted"]`` "void", its outputs' allocation fails in
    the compiled post (which posts void: its stream takes the peers' rows and stores none), or
    "never", nothing is posted (its receivers wait out the deadline). Then two more calls. Returns
    what each call raised or whether it equals the first call's outputs."""
    from warmlink.ep.paths.planned import FreshPlan

    mine = case_inputs(case)[rank]
    device = rank_device(rank, case)
    x, idx = _to(mine["x"], device), mine["topk_idx"].to(device)
    got: dict = {"calls": []}
    with _buffer(rank, num_ranks, store, case) as buf:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case["experts"])
        kw = {"topk_idx": idx, "topk_weights": mine["topk_weights"].to(device), "num_tokens_per_rank": per_rank,
              "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}  # (a kind the compiled check takes)
        want = [_cpu(t) for t in buf.dispatch(x, **kw)[:3]]
        for _ in range(2):
            buf.dispatch(x, **kw)
        torch.cuda.synchronize(device)
        plans = list(buf._normal.path._plans.values())
        got["plans"] = len(plans)
        kept = [(plan._post_args, plan._compiled) for plan in plans]
        if rank == 0:
            for plan in plans:
                if case["unposted"] == "void":  # 8 rows of 2^63 bytes: at::empty raises
                    plan._post_args = (*plan._post_args[:5], 1 << 60, *plan._post_args[6:])
                else:
                    plan._compiled = _NoPost(plan._compiled)
        for call in range(3):
            try:
                out = buf.dispatch(x, **kw)
                torch.cuda.synchronize(device)
                same = all(torch.equal(_cpu(a), b) for a, b in zip(out[:3], want))
                got["calls"].append("same" if same else "differs")
            except Exception as exc:  # noqa: BLE001 - the test compares the type name
                got["calls"].append(f"{type(exc).__name__}: {exc}")
            if call == 0:
                for plan, (args, compiled) in zip(plans, kept):
                    plan._post_args, plan._compiled = args, compiled
    return got


class _NoPost:
    """ep.kernels.host's module but for its posts: none goes out, and the call fails."""

    def __init__(self, module) -> None:
        self.module = module

    def __getattr__(self, name):
        return getattr(self.module, name)

    def post_outputs(self, *args):
        raise MemoryError("injected: the host failed before its post")

    def post_void(self, *args):
        pass


def merged_combine(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """``dispatch_combine`` with the CUDA combine's programs each taking ``case["merge"]`` adjacent
    dispatch channels (stream.cu's Merged channels), whatever the rank count."""
    from warmlink.ep.kernels import stream_cuda

    stream_cuda.combine_merge = lambda num_ranks, channels: case["merge"]
    return dispatch_combine(rank, num_ranks, store, case)
