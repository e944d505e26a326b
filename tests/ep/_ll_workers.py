"""Rank-side scenarios of the low-latency tests, run by ``_group.run_ranks`` on shm.

Every rank builds every rank's inputs from one seed (``ll_inputs``), so the parent can run the
oracle over all of them. Tokens follow DeepEP's test pattern: every channel of rank ``r``'s
token holds ``r - 128``, but the last 128, which hold the token index; each block of 128
channels is then constant, so the FP8 cast is exact and a received row names its source.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

RANK_OFFSET = 128


def ll_inputs(case: dict) -> list[dict]:
    """Per rank: ``x`` (BF16, DeepEP's pattern, or random with ``random_x``), ``topk_idx`` (distinct
    experts per token, ``masked`` random entries set to -1, token 0 masked entirely) and
    ``topk_weights``."""
    out = []
    for r, tokens in enumerate(case["tokens"]):
        gen = torch.Generator().manual_seed(case.get("seed", 0) * 1000 + r)
        scores = torch.rand(tokens, case["experts"], generator=gen)
        idx = scores.topk(case["topk"], dim=1).indices
        for _ in range(case.get("masked", 0) if tokens else 0):
            idx[torch.randint(tokens, (1,), generator=gen), torch.randint(case["topk"], (1,), generator=gen)] = -1
        if tokens > 1 and case.get("masked"):
            idx[0] = -1  # a token that goes nowhere combines to zeros
        if case.get("random_x"):
            x = (torch.randn(tokens, case["hidden"], generator=gen) * 3).to(torch.bfloat16)
        else:
            x = torch.full((tokens, case["hidden"]), float(r - RANK_OFFSET), dtype=torch.bfloat16)
            x[:, -128:] = torch.arange(tokens, dtype=torch.bfloat16).view(-1, 1)
        w = torch.rand(tokens, case["topk"], generator=gen)
        out.append({"x": x, "topk_idx": idx, "topk_weights": w})
    return out


def decode_scales(scales: torch.Tensor, hidden: int) -> torch.Tensor:
    """float32 ``[..., H/128]`` from DeepEP's scales: float32 as they are, packed UE8M0 int32 decoded."""
    if scales.dtype == torch.float32:
        return scales
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    exponents = (scales.unsqueeze(-1) >> shifts) & 0xFF  # byte j of word w is block 4 w + j
    exponents = exponents.reshape(*scales.shape[:-1], -1)[..., :hidden // 128]
    return torch.exp2(exponents.float() - 127)


def dequantized(recv_x, hidden: int) -> torch.Tensor:
    """BF16 ``[L, R*T, H]`` of what low_latency_dispatch returned (FP8 pairs cast back)."""
    if not isinstance(recv_x, tuple):
        return recv_x.clone()
    q, scales = recv_x
    s = decode_scales(scales, hidden)
    blocks = q.float().view(*q.shape[:-1], hidden // 128, 128) * s.unsqueeze(-1)
    return blocks.view(q.shape).to(torch.bfloat16)


def expert_output(y: torch.Tensor, rank: int, local_experts: int) -> torch.Tensor:
    """A stand-in for the experts: local expert ``e`` of ``rank`` scales its rows by ``2 ** (g % 3)``
    (``g`` its global id; exact in BF16), so the combine tells which expert each row came back from."""
    g = torch.arange(local_experts) + rank * local_experts
    return (y.float() * torch.exp2((g % 3).float()).view(-1, 1, 1)).to(torch.bfloat16)


def _device(case: dict) -> str:
    """Where a case's tensors live: ``"cuda"`` for ``backend="cuda_ipc"`` (the device path), else the host."""
    return "cuda" if case.get("backend") == "cuda_ipc" else "cpu"


def _mine(case: dict, rank: int) -> dict:
    """This rank's inputs where the case runs; on GPUs each rank takes GPU ``rank % count`` first
    (ranks share GPUs when there are fewer GPUs than ranks)."""
    if _device(case) == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return {k: v.to(_device(case)) for k, v in ll_inputs(case)[rank].items()}


def _buffer(rank, num_ranks, store, case):
    from warmlink.ep import Buffer

    return Buffer(store, rank, num_ranks, max_tokens_per_rank=case.get("max_tokens", max(case["tokens"])),
                  hidden=case["hidden"], num_topk=case.get("num_topk", case["topk"]), backend=case.get("backend", "shm"),
                  timeout_s=case.get("timeout_s", 30.0), low_latency_mode=True, num_experts=case["experts"],
                  enable_shrink=case.get("enable_shrink", False))


def _dispatch(buf, mine: dict, case: dict, call: dict, stats):
    delay = call.get("hook_delay_s")
    out = buf.low_latency_dispatch(mine["x"], mine["topk_idx"], case.get("call_tokens", max(case["tokens"])),
                                   case["experts"], cumulative_local_expert_recv_stats=stats,
                                   use_fp8=call.get("fp8", True), round_scale=call.get("round_scale", False),
                                   use_ue8m0=call.get("ue8m0", False), return_recv_hook=delay is not None,
                                   async_finish=delay is None)
    if delay is not None:
        assert out[4] is not None
        time.sleep(delay)
        out[4]()
    else:
        assert out[4] is None
        out[3].current_stream_wait()
    return out


def _received(recv_x, count, handle, stats) -> dict:
    """Host copies of what one dispatch returned (its outputs are reused two dispatches later)."""
    def copy(t):
        return t.to("cpu", copy=True)

    return {"count": copy(count), "stats": copy(stats), "src_info": copy(handle[0]), "layout_range": copy(handle[1]),
            "handle_sizes": list(handle)[2:],
            "recv_x": tuple(copy(t) for t in recv_x) if isinstance(recv_x, tuple) else copy(recv_x)}


def ll_rounds(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """One dispatch + combine per entry of ``case["calls"]`` (``fp8``, ``round_scale``, ``ue8m0``,
    ``hook_delay_s``, ``out``, ``zero_copy``: the rows written into the next combine buffer), repeated ``case.get("repeat", 1)`` times; returns this rank's
    outputs of each (copies)."""
    mine, dev = _mine(case, rank), _device(case)
    local = case["experts"] // num_ranks
    results = []
    with _buffer(rank, num_ranks, store, case) as buf:
        for call in case["calls"] * case.get("repeat", 1):
            stats = torch.zeros(local, dtype=torch.int32, device=dev)
            recv_x, count, handle, _, _ = _dispatch(buf, mine, case, call, stats)
            got = _received(recv_x, count, handle, stats)
            y = expert_output(dequantized(got["recv_x"], case["hidden"]), rank, local).to(dev)
            out = torch.empty(len(mine["x"]), case["hidden"], dtype=torch.bfloat16, device=dev) if call.get("out") else None
            delay = call.get("hook_delay_s")
            zero_copy = bool(call.get("zero_copy"))
            if zero_copy:  # DeepEP's zero-copy loop: the rows go into the buffer, and x (zeros here) is not read
                buf.get_next_low_latency_combine_buffer(handle)[:] = y
                y = torch.zeros_like(y)
            combined, _, hook = buf.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], handle,
                                                        return_recv_hook=delay is not None, out=out,
                                                        zero_copy=zero_copy)
            if delay is not None:
                time.sleep(delay)
                hook()
            assert out is None or combined.data_ptr() == out.data_ptr()
            got["combined"] = combined.to("cpu", copy=True)
            results.append(got)
    return results


def ll_two_batches(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """Micro-batches A and B (``case["seeds"]``) overlapped as a decode step does: dispatch A and B
    (hooks), A's hook, A's combine (hook), B's hook, B's combine (hook), then the combines' hooks."""
    batches = [_mine(dict(case, seed=seed), rank) for seed in case["seeds"]]
    local, tokens, dev = case["experts"] // num_ranks, max(case["tokens"]), _device(case)
    got = [{}, {}]
    with _buffer(rank, num_ranks, store, case) as buf:
        stats = [torch.zeros(local, dtype=torch.int32, device=dev) for _ in batches]
        sent = [buf.low_latency_dispatch(b["x"], b["topk_idx"], tokens, case["experts"], return_recv_hook=True,
                                         cumulative_local_expert_recv_stats=s) for b, s in zip(batches, stats)]
        combines = []
        for i, (b, (recv_x, count, handle, _, hook)) in enumerate(zip(batches, sent)):
            time.sleep(0.005)  # the other micro-batch's work
            hook()
            got[i] = _received(recv_x, count, handle, stats[i])
            y = expert_output(dequantized(got[i]["recv_x"], case["hidden"]), rank, local).to(dev)
            combines.append(buf.low_latency_combine(y, b["topk_idx"], b["topk_weights"], handle, return_recv_hook=True))
        for i, (combined, _, hook) in enumerate(combines):
            hook()
            got[i]["combined"] = combined.to("cpu", copy=True)
    return got


def ll_calls_keep_their_order(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Calls of one Buffer keep their issue order on the device (ep.paths.comm_stream, Note
    [Communication stream]). With the communication stream held on a host word, an async BF16
    dispatch of batch 0, then dispatches of batches 1 and 2 on the caller's stream (batch 2's is
    of batch 0's parity, whose sequence word and output views batch 0's kernels, once released,
    would advance and overwrite); released, returns each batch's valid rows beside the same
    three calls made unheld before. With ``case["deep_ep"]`` through ``deep_ep.Buffer``, whose
    own communication stream runs its async calls."""
    from tests.ep._workers import _held

    batches = [_mine(dict(case, seed=seed), rank) for seed in case["seeds"]]
    tokens, n = max(case["tokens"]), len(batches)

    def valid(out) -> dict:  # the rows each local expert received (rows past its count are stale)
        recv_x, count, handle = out[0], out[1].cpu(), out[2]
        return {"count": count, "rows": [recv_x[e, :int(c)].cpu() for e, c in enumerate(count)],
                "src_info": [handle[0][e, :int(c)].cpu() for e, c in enumerate(count)]}

    def call(i, **kw):
        b = batches[i]
        return buf.low_latency_dispatch(b["x"], b["topk_idx"], tokens, case["experts"], use_fp8=False, **kw)

    got = {}
    with contextlib.ExitStack() as stack:
        if case.get("deep_ep"):
            import warmlink.ep.deep_ep as deep_ep
            from tests.ep._deep_ep_workers import gloo_group

            group = stack.enter_context(gloo_group(rank, num_ranks, case["dist_port"]))
            rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, case["hidden"], num_ranks, case["experts"],
                                                                 num_topk=case["topk"])
            buf = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=case["experts"] // num_ranks,
                                 explicitly_destroy=True, timeout_s=30)
            stack.callback(buf.destroy)
        else:
            buf = stack.enter_context(_buffer(rank, num_ranks, store, case))
        for _ in range(2):  # every kernel compiled, the communication stream leased
            first = call(0, async_finish=True)
            first[3].current_stream_wait()
            unheld = [valid(first)] + [valid(call(i)) for i in range(1, n)]
        with _held(buf.get_comm_stream().cuda_stream) as release:
            first = call(0, async_finish=True)
            later = [call(i) for i in range(1, n)]
            release()
            first[3].current_stream_wait()
            torch.cuda.synchronize()
            got["held_last"] = valid(later[-1])
        got["unheld_last"] = unheld[-1]
    return got


def ll_graph(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """A BF16 dispatch + hook + experts + combine + hook captured once in a CUDA graph, then
    replayed once per seed of ``case["seeds"]`` with that seed's inputs copied into the captured
    ones; returns each replay's outputs."""
    batches = [_mine(dict(case, seed=seed), rank) for seed in case["seeds"]]
    local, tokens, hidden = case["experts"] // num_ranks, max(case["tokens"]), case["hidden"]
    static = {k: v.clone() for k, v in batches[0].items()}
    stats = torch.zeros(local, dtype=torch.int32, device="cuda")
    out = torch.empty(len(static["x"]), hidden, dtype=torch.bfloat16, device="cuda")
    factors = torch.exp2(((torch.arange(local) + rank * local) % 3).float()).view(-1, 1, 1).cuda()  # expert_output's
    results = []
    with _buffer(rank, num_ranks, store, case) as buf:
        def step():
            recv_x, count, handle, _, hook = buf.low_latency_dispatch(
                static["x"], static["topk_idx"], tokens, case["experts"], use_fp8=False, return_recv_hook=True,
                cumulative_local_expert_recv_stats=stats)
            hook()
            y = (recv_x.float() * factors).to(torch.bfloat16)
            _, _, hook = buf.low_latency_combine(y, static["topk_idx"], static["topk_weights"], handle,
                                                 return_recv_hook=True, out=out)
            hook()
            return recv_x, count, handle

        for _ in range(2):  # both parities once, eagerly: every kernel is compiled before the capture
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv_x, count, handle = step()
        for b in batches:
            for k in static:
                static[k].copy_(b[k])
            stats.zero_()
            graph.replay()
            got = _received(recv_x, count, handle, stats)
            got["combined"] = out.cpu()
            results.append(got)
    return results


def ll_device_fault(rank: int, num_ranks: int, store, case: dict) -> dict:
    """``case["fault"]`` on the device path, where a kernel reports and a later call raises: what
    each call raised here (``"ok"`` when nothing did)."""
    mine = _mine(case, rank)
    report = {}

    def attempt(name: str, call) -> None:
        try:
            call()
            torch.cuda.synchronize()
            report[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test compares the type name
            report[name] = f"{type(exc).__name__}: {exc}"

    with _buffer(rank, num_ranks, store, case) as buf:
        fp8 = {"fp8": True}
        if case["fault"] == "stalled_peer":  # rank 1 makes no call for longer than the timeout
            if rank == 1:
                time.sleep(3 * case["timeout_s"])
                return report
            attempt("dispatch", lambda: _dispatch(buf, mine, case, fp8, None))
            attempt("after", lambda: _dispatch(buf, mine, case, fp8, None))
            attempt("later", lambda: _dispatch(buf, mine, case, fp8, None))
        if case["fault"] == "fp8_differs":  # rank 1 sends BF16 where the others send FP8; then rounds alike
            attempt("dispatch", lambda: _dispatch(buf, mine, case, {"fp8": rank != 1}, None))
            attempt("after", lambda: _dispatch(buf, mine, case, fp8, None))
            recv_x = _dispatch(buf, mine, case, fp8, None)[0]
            report["recv_x"] = tuple(t.cpu() for t in recv_x)
        if case["fault"] == "clean":
            first = _dispatch(buf, mine, case, fp8, None)
            buf.clean_low_latency_buffer(max(case["tokens"]), case["hidden"], case["experts"])
            report["zeroed"] = bool((first[0][0].view(torch.uint8) == 0).all()) and bool((first[1] == 0).all())
            report["count"] = _dispatch(buf, mine, case, fp8, None)[1].cpu()
    return report


def ll_fault(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Run ``case["fault"]`` and return what each call raised here (``"ok"`` when nothing did)."""
    mine = ll_inputs(case)[rank]
    fault, report = case["fault"], {}

    def attempt(name: str, call) -> None:
        start = time.perf_counter()
        try:
            call()
            report[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test compares the type name
            report[name] = f"{type(exc).__name__}: {exc}"
        report[name + "_s"] = time.perf_counter() - start

    with _buffer(rank, num_ranks, store, case) as buf:
        call = {"fp8": True}
        if fault == "dies_before_dispatch":  # rank 1 leaves once every Buffer is built
            store.add("built", 1, checked=False)
            store.wait_until(lambda: store.add("built", 0, checked=False) >= num_ranks, what="every Buffer", timeout_s=30)
            if rank == 1:
                os._exit(0)
            attempt("dispatch", lambda: _dispatch(buf, mine, case, call, None))
        if fault == "dies_between_dispatch_and_combine":  # rank 1 sends its rows, then dies before its hook
            out = buf.low_latency_dispatch(mine["x"], mine["topk_idx"], max(case["tokens"]), case["experts"],
                                           return_recv_hook=True)
            if rank == 1:
                os._exit(0)
            attempt("dispatch", out[4])
            y = torch.zeros(*out[0][0].shape, dtype=torch.bfloat16)
            attempt("combine", lambda: buf.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], out[2]))
            attempt("after", lambda: _dispatch(buf, mine, case, call, None))
        if fault == "stalled_peer":  # rank 1 builds its Buffer, then makes no call for longer than the timeout
            if rank == 1:
                time.sleep(3 * case["timeout_s"])
                return report
            attempt("dispatch", lambda: _dispatch(buf, mine, case, call, None))
            attempt("after", lambda: _dispatch(buf, mine, case, call, None))
        if fault == "fp8_differs":  # rank 1 sends BF16 where the others send FP8; then a round alike
            attempt("dispatch", lambda: _dispatch(buf, mine, case, {"fp8": rank != 1}, None))
            recv_x = _dispatch(buf, mine, case, call, None)[0]
            report["recv_x"] = tuple(t.clone() for t in recv_x)
        if fault == "combines_differ":  # rank 0 combines the first dispatch's handle, the others the second's
            first = _dispatch(buf, mine, case, call, None)
            second = _dispatch(buf, mine, case, call, None)
            handle = first[2] if rank == 0 else second[2]
            y = torch.zeros(*first[0][0].shape, dtype=torch.bfloat16)
            attempt("combine", lambda: buf.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], handle))
        if fault == "clean":  # a round, a clean, a round: the old handle is refused, the new round is right
            first = _dispatch(buf, mine, case, call, None)
            buf.clean_low_latency_buffer(max(case["tokens"]), case["hidden"], case["experts"])
            report["zeroed"] = bool((first[0][0].view(torch.uint8) == 0).all()) and bool((first[1] == 0).all())
            y = torch.zeros(*first[0][0].shape, dtype=torch.bfloat16)
            attempt("old_handle", lambda: buf.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], first[2]))
            report["count"] = _dispatch(buf, mine, case, call, None)[1].clone()
    return report


def ll_shrink(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """DeepEP's enable_shrink: four BF16 dispatch + combine rounds; rank ``case["dies"]`` exits after
    sending its second dispatch (its rows arrive; it never combines), or with ``case["stays"]``
    stays alive calling nothing; the others mask it and go on, with a clean_low_latency_buffer
    before the fourth. Returns this rank's outputs of each round and its mask after it."""
    mine, dev = _mine(case, rank), _device(case)
    local, tokens = case["experts"] // num_ranks, max(case["tokens"])
    rounds = []
    with _buffer(rank, num_ranks, store, dict(case, enable_shrink=True)) as buf:
        def one(dies: bool = False) -> dict:
            stats = torch.zeros(local, dtype=torch.int32, device=dev)
            recv_x, count, handle, _, hook = buf.low_latency_dispatch(
                mine["x"], mine["topk_idx"], tokens, case["experts"], cumulative_local_expert_recv_stats=stats,
                use_fp8=False, return_recv_hook=True)
            if dies and rank == case["dies"]:
                if not case.get("stays"):
                    os._exit(0)
                # alive and calling nothing, as DeepEP's failing rank: its memory stays mapped
                store.wait_until(lambda: store.add("shrink-done", 0, checked=False) >= num_ranks - 1,
                                 what="the other ranks' rounds", timeout_s=120)
                return None
            hook()
            got = _received(recv_x, count, handle, stats)
            y = expert_output(got["recv_x"], rank, local).to(dev)
            combined = buf.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], handle)[0]
            got["combined"] = combined.to("cpu", copy=True)
            mask = torch.full((num_ranks,), 7, dtype=torch.int32, device=dev)
            buf.low_latency_query_mask_buffer(mask)
            got["mask"] = mask.cpu().tolist()
            return got

        rounds += [one(), one(dies=True)]
        if rounds[-1] is None:
            return "stayed"
        rounds.append(one())
        buf.clean_low_latency_buffer(tokens, case["hidden"], case["experts"])
        rounds.append(one())
        store.add("shrink-done", 1, checked=False)
    return rounds


def ll_warm(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Pool objects created by each of three dispatch + combine rounds of one Buffer, and by each of
    ``case["lifecycles"]`` Buffer lifecycles after it; the wait costs the rounds added up."""
    from warmlink import pool

    mine = ll_inputs(case)[rank]
    tokens, experts = max(case["tokens"]), case["experts"]
    costs = {"dispatch": torch.zeros(num_ranks, dtype=torch.int64), "combine": torch.zeros(num_ranks, dtype=torch.int64)}

    def created(before: dict) -> dict:
        after = {k: v["created"] for k, v in pool.stats().items()}
        return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}

    def snapshot() -> dict:
        return {k: v["created"] for k, v in pool.stats().items()}

    rounds, lifecycles = [], []
    with _buffer(rank, num_ranks, store, case) as buf:
        y = torch.zeros(experts // num_ranks, num_ranks * tokens, case["hidden"], dtype=torch.bfloat16)
        for _ in range(3):
            before = snapshot()
            handle = buf.low_latency_dispatch(mine["x"], mine["topk_idx"], tokens, experts,
                                              dispatch_wait_recv_cost_stats=costs["dispatch"])[2]
            buf.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], handle,
                                    combine_wait_recv_cost_stats=costs["combine"])
            rounds.append(created(before))
    for _ in range(case["lifecycles"]):
        before = snapshot()
        with _buffer(rank, num_ranks, store, case) as buf:
            buf.low_latency_dispatch(mine["x"], mine["topk_idx"], tokens, experts)
        lifecycles.append(created(before))
    return {"rounds": rounds, "lifecycles": lifecycles, "costs": costs}


def ll_from_group(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """``ll_rounds`` on a Buffer from ``Buffer.from_group`` over a gloo group (no store passed in)."""
    import datetime

    import torch.distributed as dist

    from warmlink.ep import Buffer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{case['dist_port']}", rank=rank,
                            world_size=num_ranks, timeout=datetime.timedelta(seconds=30))
    try:
        mine = ll_inputs(case)[rank]
        local = case["experts"] // num_ranks
        with Buffer.from_group(max_tokens_per_rank=max(case["tokens"]), hidden=case["hidden"], num_topk=case["topk"],
                               backend="shm", timeout_s=30, low_latency_mode=True, num_experts=case["experts"]) as buf:
            stats = torch.zeros(local, dtype=torch.int32)
            recv_x, count, handle, _, _ = _dispatch(buf, mine, case, case["calls"][0], stats)
            got = _received(recv_x, count, handle, stats)
            y = expert_output(dequantized(recv_x, case["hidden"]), rank, local)
            got["combined"] = buf.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], handle)[0].clone()
        return [got]
    finally:
        dist.destroy_process_group()
