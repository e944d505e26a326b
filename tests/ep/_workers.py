"""Rank-side scenarios of the ep tests, run by ``_group.run_ranks`` on shm (CPU) or cuda_ipc (GPU).

Every rank builds every rank's inputs from the same seed (``case_inputs``), so the parent can
run the oracle over all of them and compare each rank's outputs.
"""

from __future__ import annotations

import contextlib
import time

import torch

from tests.ep._reference import random_routing, token_pattern


def case_inputs(case: dict) -> list[dict]:
    """Inputs of every rank: ``x`` (tensor or FP8 tuple), ``topk_idx``, ``topk_weights`` (CPU)."""
    out = []
    for r, tokens in enumerate(case["tokens"]):
        gen = torch.Generator().manual_seed(case.get("seed", 0) * 1000 + r)
        idx = random_routing(tokens, case["experts"], case["topk"], gen, case.get("mask_prob", 0.0))
        w = torch.rand(tokens, case["topk"], generator=gen)
        out.append({"x": token_pattern(r, tokens, case["hidden"], case.get("dtype", torch.bfloat16)), "topk_idx": idx,
                    "topk_weights": w})
    return out


def _to(x, device):
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


def _cpu(x):
    if x is None:
        return None
    return tuple(t.cpu().clone() for t in x) if isinstance(x, tuple) else x.cpu().clone()


def _shifted(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A copy of ``x`` that starts ``nbytes`` into a fresh allocation (allocations are aligned)."""
    skip = nbytes // x.element_size()
    out = torch.empty(x.numel() + skip, dtype=x.dtype, device=x.device)[skip:].view(x.shape)
    return out.copy_(x)


def scales_laid_out(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """The same FP8 scales with other strides: ``"row"`` as they are, ``"column"`` column-major as
    DeepEP's tests pass them (``s.T.contiguous().T``, strides ``(1, T)``), ``"wider"`` a view into a
    wider tensor (token stride ``S + 3``, its first element 4 bytes past the allocation's)."""
    if layout == "row":
        return scales
    if layout == "column":
        return scales.T.contiguous().T
    wide = torch.full((scales.shape[0], scales.shape[1] + 3), float("nan"), dtype=scales.dtype, device=scales.device)
    wide[:, 1:1 + scales.shape[1]] = scales
    return wide[:, 1:1 + scales.shape[1]]


def rank_device(rank: int, case: dict) -> torch.device:
    """Where rank ``rank`` works: host memory on shm; on cuda_ipc GPU ``rank % device_count``, so
    that ranks share GPUs when there are fewer GPUs than ranks (two processes on one GPU still
    map each other's memory over CUDA IPC and run every send path, at no link speed)."""
    if case.get("backend") != "cuda_ipc":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _buffer(rank, num_ranks, store, case):
    from warmlink.ep import Buffer

    on = rank_device(rank, case)
    device = -1 if on.type == "cpu" else on.index
    if device >= 0:
        torch.cuda.set_device(device)
    return Buffer(store, rank, num_ranks, max_tokens_per_rank=case.get("max_tokens", max(case["tokens"]) or 1),
                  hidden=case["hidden"], num_topk=case["topk"], device=device, backend=case.get("backend", "shm"),
                  timeout_s=case.get("timeout_s", 30.0), combine_parts=case.get("combine_parts"),
                  send=case.get("send"), copy_streams=case.get("copy_streams"),
                  stream_channels=case.get("stream_channels"), ring_rows=case.get("ring_rows"))


def dispatch_combine(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """``case["rounds"]`` dispatch + combine rounds; returns this rank's outputs of each round.

    case keys: tokens (per rank), hidden, experts, topk, dtype, mask_prob, seed, backend, rounds,
    hook_delay_s (None = normal mode), cached (re-dispatch with the handle, ``cached_repeats``
    times), misaligned_x (x 8 bytes past a 16-byte boundary), layout (pass get_dispatch_layout's outputs), combine_dtype, skew_s (ranks read their
    outputs and start the next call after different sleeps, so fast ranks run ahead), late_start_s
    (every rank but 0 starts that late), num_worst_tokens and expert_alignment (DeepEP's padding
    arguments), async_finish (the returned events are waited on), combine_parts, copy_streams and send (the
    Buffer's arguments, on every rank).
    """
    mine = case_inputs(case)[rank]
    device = rank_device(rank, case)
    x, idx, w = _to(mine["x"], device), mine["topk_idx"].to(device), mine["topk_weights"].to(device)
    if case.get("misaligned_x"):  # x 8 bytes past a 16-byte boundary, as views into larger tensors are
        x = _shifted(x, 8)
    delay = case.get("hook_delay_s")
    results = []
    calls = iter(range(1 << 30))

    def skew() -> None:  # rank r sleeps skew_s * ((r + call) % R): a different rank is slowest each call
        if case.get("skew_s"):
            time.sleep(case["skew_s"] * ((rank + next(calls)) % num_ranks))

    with _buffer(rank, num_ranks, store, case) as buf:
        if rank and case.get("late_start_s"):  # every rank but 0 makes its first call late
            time.sleep(case["late_start_s"])
        for _ in range(case.get("rounds", 1)):
            kwargs = {"topk_idx": idx, "topk_weights": w}
            if case.get("layout", True):
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case["experts"])
                kwargs.update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
            else:
                kwargs["num_experts"] = case["experts"]
            kwargs.update({k: case[k] for k in ("num_worst_tokens", "expert_alignment", "async_finish") if k in case})
            out = buf.dispatch(x, **kwargs, return_recv_hook=delay is not None)
            if delay is not None:
                time.sleep(delay)
                out[-1]()
            recv_x, recv_idx, recv_w, per_expert_list, handle, event = out[:6]
            if case.get("async_finish"):
                event.current_stream_wait()
            skew()
            got = {"recv_x": _cpu(recv_x), "recv_topk_idx": _cpu(recv_idx), "recv_topk_weights": _cpu(recv_w),
                   "num_recv_tokens_per_expert_list": per_expert_list, "num_recv_tokens": handle.num_recv_tokens,
                   "handle_per_expert": list(handle.num_recv_tokens_per_expert_list), "event": repr(event)}
            if case.get("cached"):
                got["cached_x"] = []
                for j in range(case.get("cached_repeats", 1)):  # odd repeats send -x: rounds differ in every byte
                    again = buf.dispatch(-x if j % 2 and not isinstance(x, tuple) else x, handle=handle,
                                         return_recv_hook=delay is not None)
                    if delay is not None:
                        time.sleep(delay)
                        again[-1]()
                    skew()
                    got["cached_x"].append(_cpu(again[0]))
            y = recv_x[0].float().to(torch.bfloat16) if isinstance(recv_x, tuple) else recv_x.clone()
            skew()
            comb = buf.combine(y, handle, topk_weights=recv_w, return_recv_hook=delay is not None)
            if delay is not None:
                time.sleep(delay)
                comb[-1]()
            got["combined_x"], got["combined_w"] = _cpu(comb[0]), _cpu(comb[1])
            got["y"] = _cpu(y)[:handle.num_recv_tokens]  # a padded dispatch's extra rows are not combined
            results.append(got)
    return results


def after_an_earlier_lifecycle(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """A Buffer with ``case["before"]``'s inputs dispatches once and closes; then
    ``dispatch_combine`` of ``case`` on a new Buffer of the same sizes, which the pool gives the
    same region, with the earlier Buffer's bytes still in it."""
    before = dict(case, **case["before"])
    mine = _mine_on_device(rank, before)
    with _buffer(rank, num_ranks, store, before) as buf:
        buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"], num_experts=case["experts"])
    return dispatch_combine(rank, num_ranks, store, case)


def changing_rounds(rank: int, num_ranks: int, store, case: dict) -> dict:
    """One fresh dispatch per entry of ``case["rounds_cases"]`` (each a case: its own tokens, seed,
    dtype; ``weights`` False sends none; ``cached`` adds two cached re-dispatches of ``-x``), in
    order, on one Buffer: new tensors at new addresses and new token counts every call, through
    the same kernels (on GPUs, graphs replayed from the second call of a parity and shape,
    ep.paths.sm_pushes, Note [Fresh send graph]); with ``case["layout"]``, get_dispatch_layout's
    outputs passed. Returns this rank's outputs per round, the kinds of launch its mover captured
    as graphs and the kinds of fresh dispatch a streamed path planned (ep.paths.planned)."""
    subs = [dict(case, **sub) for sub in case["rounds_cases"]]
    device = rank_device(rank, case)
    results = []
    with _buffer(rank, num_ranks, store, dict(case, tokens=[max(max(s["tokens"]) for s in subs) or 1])) as buf:
        for sub in subs:
            mine = case_inputs(sub)[rank]
            x, idx = _to(mine["x"], device), mine["topk_idx"].to(device)
            w = mine["topk_weights"].to(device) if sub.get("weights", True) else None
            routing = {"num_experts": case["experts"]}
            if case.get("layout"):  # get_dispatch_layout's outputs, as DeepEP's callers pass them
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case["experts"])
                routing = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
                           "num_tokens_per_expert": per_expert}
            recv_x, recv_idx, recv_w, per_expert_list, handle = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                             **routing)[:5]
            got = {"recv_x": _cpu(recv_x), "recv_topk_idx": _cpu(recv_idx), "recv_topk_weights": _cpu(recv_w),
                   "num_recv_tokens_per_expert_list": per_expert_list}
            # cached re-dispatches of -x (new tensors), one in each parity
            got["cached_x"] = [_cpu(buf.dispatch(-x, handle=handle)[0]) for _ in range(2 if sub.get("cached") else 0)]
            results.append(got)
        kinds = sorted({key[0] for key in getattr(buf._mover, "_graphs", {})})
        plans = len(getattr(getattr(buf._normal, "path", None), "_plans", {}))  # a streamed path's (ep.paths.planned)
    return {"rounds": results, "graph_kinds": kinds, "plans": plans}


def fp8_inputs(case: dict, rank: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Rank ``rank``'s FP8 x of ``case`` (tokens, seed, hidden, experts, topk) as random bytes and
    row-major scales as random float32 bit patterns (NaNs included), and its routing (CPU)."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + rank)
    t, h = case["tokens"][rank], case["hidden"]
    values = torch.randint(0, 256, (t, h), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    bits = torch.randint(-(1 << 31), 1 << 31, (t, -(-h // 128)), generator=gen, dtype=torch.int64)
    idx = random_routing(t, case["experts"], case["topk"], gen, case.get("mask_prob", 0.0))
    return (values, bits.to(torch.int32).view(torch.float32)), idx


def fp8_scale_layouts(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """One fresh FP8 dispatch per entry of ``case["rounds_cases"]`` (each: its tokens, seed and
    ``scales`` layout, ``scales_laid_out``), then ``cached`` re-dispatches with its handle, on one
    Buffer (on GPUs the graphs captured by one layout's call are replayed by the other's: ep.kernels.steps,
    Note [Scales in place]). Per round: what arrived (FP8 bytes, scales as int32 bits) and, per
    call, the caller's scales ``(address, strides)`` and each ``(address, strides)`` a device step
    was given: ``gather``'s ``src.scales``, or the words of the call block an SM push read."""
    from warmlink.ep.kernels import steps as _kernels
    from warmlink.ep.kernels.call_block import CALL_SLOTS

    device = rank_device(rank, case)
    seen: list[tuple] = []
    real_gather = _kernels.gather

    def gather(rows, src, *args, **kwargs):  # every path's gather (the torch one and the kernel) is called here
        if src.scales is not None:
            seen.append((src.scales.data_ptr(), *src.scales.stride()))
        return real_gather(rows, src, *args, **kwargs)

    at = [CALL_SLOTS.index(name) for name in ("scales", "scales_token_stride", "scales_col_stride")]
    results = []
    subs = [dict(case, **sub) for sub in case["rounds_cases"]]
    _kernels.gather = gather
    try:
        with _buffer(rank, num_ranks, store, dict(case, tokens=[max(max(s["tokens"]) for s in subs) or 1])) as buf:
            mover = buf._mover

            def call(x, **kwargs):
                del seen[:]
                out = buf.dispatch(x, **kwargs)
                cached = "handle" in kwargs
                # an SM send's call block, and a cached CUDA send's (its push, also behind the copy engines)
                if buf._normal.path.name == "sm" or (cached and hasattr(mover, "_cached_words")):
                    parity = buf._normal.rounds.last["dispatch"] % 2  # this call's block (ep.paths.sm_pushes)
                    block = mover._cached_words[parity] if cached else mover._call_words
                    seen.append(tuple(int(block[i]) for i in at))
                return {"x": _cpu(out[0]), "want": (x[1].data_ptr(), *x[1].stride()), "seen": list(seen)}, out[4]

            for sub in subs:
                (values, scales), idx = fp8_inputs(sub, rank)
                x = (values.to(device), scales_laid_out(scales.to(device), sub["scales"]))
                fresh, handle = call(x, topk_idx=idx.to(device), num_experts=case["experts"])
                results.append({"fresh": fresh, "cached": [call(x, handle=handle)[0] for _ in range(sub.get("cached", 1))]})
    finally:
        _kernels.gather = real_gather
    return results


def _mine_on_device(rank: int, case: dict) -> dict:
    mine = case_inputs(case)[rank]
    device = rank_device(rank, case)
    return {k: _to(v, device) for k, v in mine.items()}


def lifecycle_counts(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Build, use and close a Buffer ``case["lifecycles"]`` times; pool objects created per lifecycle."""
    from warmlink import pool
    from warmlink.pool.peers import open_mappings

    mine = _mine_on_device(rank, case)
    created, mappings = [], []
    for _ in range(case["lifecycles"]):
        before = {k: v["created"] for k, v in pool.stats().items()}
        with _buffer(rank, num_ranks, store, case) as buf:
            buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"], num_experts=case["experts"])
        after = {k: v["created"] for k, v in pool.stats().items()}
        created.append({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})
        mappings.append(open_mappings())
    return {"created": created, "mappings": mappings, "live": {k: v["live"] for k, v in pool.stats().items()}}


def warm_rounds(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """Pool objects created by each dispatch + combine round of one Buffer (round 2 on: none)."""
    from warmlink import pool

    mine = _mine_on_device(rank, case)
    out = []
    with _buffer(rank, num_ranks, store, case) as buf:
        for _ in range(3):
            before = {k: v["created"] for k, v in pool.stats().items()}
            r = buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"], num_experts=case["experts"])
            buf.combine(r[0].clone(), r[4])
            after = {k: v["created"] for k, v in pool.stats().items()}
            out.append({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})
    return out


def expect_error(rank: int, num_ranks: int, store, case: dict) -> str:
    """Run the faulty scenario ``case["fault"]`` and return the name and message of what this rank raised."""
    mine = case_inputs(case)[rank]
    fault = case["fault"]
    gpu = case.get("backend") == "cuda_ipc"
    try:
        with _buffer(rank, num_ranks, store, dict(case, **case.get("per_rank", {}).get(rank, {}))) as buf:
            device = rank_device(rank, case)
            x, idx = _to(mine["x"], device), mine["topk_idx"].to(device)
            if fault == "bad_expert" and rank == 0:
                idx = idx.clone()
                idx[0, 0] = case["experts"] + 3
            if fault == "oversize" and rank == 0:
                x = torch.cat([x, x])
                idx = torch.cat([idx, idx])
            if fault == "bad_counts" and rank == 0:  # num_tokens_per_rank that is_token_in_rank contradicts
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case["experts"])
                buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank + 1, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert)
            if fault == "dead_peer":  # rank 1 dies once every rank has its Buffer: the peers then see
                # its death in a dispatch, not a peer's exit while they still open its region
                store.add("built", 1, checked=False)
                if rank == 1:
                    import os

                    store.wait_until(lambda: store.add("built", 0, checked=False) >= num_ranks, what="every Buffer",
                                     timeout_s=case.get("timeout_s", 30.0))
                    os._exit(0)  # leaves without a word, as a crashed process does
            if fault == "hook_skipped":
                out = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"], return_recv_hook=True)
                try:
                    buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
                except Exception as exc:  # noqa: BLE001 - the test compares the type name
                    out[-1]()
                    return f"{type(exc).__name__}: {exc}"
            if fault == "stale_handle":  # rank 0 combines with the first dispatch's handle, the others the second's
                first = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
                y_first, h_first = first[0].clone(), first[4]
                second = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
                y, h = (y_first, h_first) if rank == 0 else (second[0].clone(), second[4])
                if not gpu:
                    buf.combine(y, h)
                    return "ok"
                try:  # the device does not wait for the peers: the combine refuses the peers that published,
                    buf.combine(y, h)  # and the next call, once every rank has, the others
                    refused = None
                except Exception as exc:  # noqa: BLE001 - the test compares the type name
                    refused = f"{type(exc).__name__}: {exc}"
                store.add("combined", 1, checked=False)
                store.wait_until(lambda: store.add("combined", 0, checked=False) >= num_ranks, what="every combine",
                                 timeout_s=case.get("timeout_s", 30.0))
                if refused:
                    return refused
                buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
                return "ok"
            if fault == "dies_after_dispatch":  # rank 1 dies once the others launched their combine
                out = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
                if rank == 1:
                    import os

                    store.wait_until(lambda: store.add("launched", 0, checked=False) >= num_ranks - 1,
                                     what="the peers' combines", timeout_s=case.get("timeout_s", 30.0))
                    os._exit(0)
                buf.combine(out[0].clone(), out[4])  # returns at launch: rank 1's rows never come
                store.add("launched", 1, checked=False)
                start = time.perf_counter()
                torch.cuda.synchronize(device)  # the watchdog releases the receive stream
                drained = time.perf_counter() - start
                try:
                    buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
                except Exception as exc:  # noqa: BLE001 - the test compares the type name
                    return f"{type(exc).__name__}: {exc} [drained in {drained:.1f} s]"
                return "ok"
            if fault == "mixed_hook":  # rank 0 asks for a hook (copy engines), the others do not (SMs)
                out = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"], return_recv_hook=rank == 0)
                if rank == 0:
                    out[-1]()
                return "ok"
            if fault == "worst_too_small_then_exact":  # every rank refuses the padded round; the next works
                hook, first, padded_ids = bool(case.get("hook")), "ok", None
                try:  # raised by the call, or, when it returned at launch (SM sends), by the next one
                    out = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"], num_worst_tokens=1,
                                       return_recv_hook=hook)
                    padded_ids = _cpu(out[1])
                    first = "returned"
                    buf.dispatch(x, topk_idx=idx, num_experts=case["experts"], return_recv_hook=hook)
                except Exception as exc:  # noqa: BLE001 - the test compares the type name
                    error = f"{type(exc).__name__}: {exc}"
                    first = f"returned, then {error}" if first == "returned" else error
                out = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"], return_recv_hook=hook)
                if hook:
                    out[-1]()
                return first, _cpu(out[0]), padded_ids
            if fault == "refused_then_valid":  # rank 0's bad input spends the round on every rank; the next works
                kwargs = _refused_call(buf, x, idx, case) if rank == 0 else {"x": x, "topk_idx": idx,
                                                                             "num_experts": case["experts"]}
                worst, first, padded_ids = case.get("worst", 0), "ok", None
                try:  # raised by the call, or, when a padded call returned at launch, by the next one
                    out = buf.dispatch(**dict(kwargs, num_worst_tokens=kwargs.get("num_worst_tokens", worst)))
                    padded_ids, first = _cpu(out[1]), "returned"
                    buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
                except Exception as exc:  # noqa: BLE001 - the test compares the type name
                    error = f"{type(exc).__name__}: {exc}"
                    first = f"returned, then {error}" if first == "returned" else error
                recv_x = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])[0]
                return first, _cpu(recv_x), padded_ids
            buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
    except Exception as exc:  # noqa: BLE001 - the test compares the type name
        message = f"{type(exc).__name__}: {exc}"
        if gpu:  # no kernel may be left waiting on the peers: the device drains at once
            start = time.perf_counter()
            torch.cuda.synchronize(rank_device(rank, case))
            if time.perf_counter() - start > 1.0:
                message += f" [the device took {time.perf_counter() - start:.1f} s to drain]"
        return message
    return "ok"


def _refused_call(buf, x, idx, case: dict) -> dict:
    """``dispatch`` arguments that fail one of rank 0's own checks, or (``other_dtype``) that pass
    them but differ from the peers' call: ``case["refusal"]`` names which."""
    kind, experts = case.get("refusal", "bad_expert"), case["experts"]
    args = {"x": x, "topk_idx": idx, "num_experts": experts}
    if kind == "bad_expert":  # seen by the plan (on the device with SM sends)
        bad = idx.clone()
        bad[0, 0] = experts + 3
        return dict(args, topk_idx=bad)
    if kind == "oversize":  # more tokens than the Buffer holds
        return dict(args, x=torch.cat([x, x]), topk_idx=torch.cat([idx, idx]))
    if kind == "bad_counts":  # num_tokens_per_rank that is_token_in_rank contradicts
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        return {"x": x, "topk_idx": idx, "num_tokens_per_rank": per_rank + 1, "is_token_in_rank": in_rank,
                "num_tokens_per_expert": per_expert}
    if kind == "bad_shape":  # an is_token_in_rank of one row too few
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        return {"x": x, "topk_idx": idx, "num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank[:-1],
                "num_tokens_per_expert": per_expert}
    if kind == "bad_worst":  # more padded rows than the receive area holds
        return dict(args, num_worst_tokens=10**6)
    if kind == "other_dtype":  # not refused here: rows of the same size, under another config than the peers'
        return dict(args, x=x.to(torch.float16))
    raise ValueError(f"_refused_call: unknown refusal {kind!r}")


def hook_leaves_streams_idle(rank: int, num_ranks: int, store, case: dict) -> dict:
    """After the send phase of a hook-mode dispatch, the caller's stream drains with the hook not
    called (no kernel waits for the bytes), and the hook still completes the same outputs."""
    mine = _mine_on_device(rank, case)
    with _buffer(rank, num_ranks, store, case) as buf:
        normal = buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"], num_experts=case["experts"])
        want = [_cpu(t) for t in normal[:3]]
        out = buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"],
                           num_experts=case["experts"], return_recv_hook=True)
        stream = torch.cuda.current_stream()
        deadline = time.monotonic() + 5.0
        while not stream.query():
            if time.monotonic() > deadline:
                return {"idle": False}
            time.sleep(1e-4)
        idle_after_s = 5.0 - (deadline - time.monotonic())
        time.sleep(0.02)
        out[-1]()
        got = [_cpu(t) for t in out[:3]]
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    return {"idle": True, "idle_after_s": idle_after_s, "same": same}


def from_group_round(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """``Buffer.from_group`` over a gloo group (no store passed in): one dispatch + combine round."""
    import datetime

    import torch.distributed as dist

    from warmlink.ep import Buffer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{case['dist_port']}", rank=rank, world_size=num_ranks,
                            timeout=datetime.timedelta(seconds=30))
    try:
        mine = case_inputs(case)[rank]
        with Buffer.from_group(max_tokens_per_rank=max(case["tokens"]), hidden=case["hidden"], num_topk=case["topk"],
                               backend="shm", timeout_s=30) as buf:
            assert buf._owned_store is not None
            recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(
                mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"], num_experts=case["experts"])
            got = {"recv_x": _cpu(recv_x), "recv_topk_idx": _cpu(recv_idx), "recv_topk_weights": _cpu(recv_w),
                   "num_recv_tokens_per_expert_list": per_expert, "y": _cpu(recv_x)}
            out, out_w, _ = buf.combine(recv_x.clone(), handle, topk_weights=recv_w)
            got["combined_x"], got["combined_w"] = _cpu(out), _cpu(out_w)
        return [got]
    finally:
        dist.destroy_process_group()


def from_group_across_hosts(rank: int, num_ranks: int, store, case: dict) -> str:
    """``Buffer.from_group`` with the last rank seeing another machine's boot id: what each rank raised."""
    import datetime

    import torch.distributed as dist

    from warmlink.ep import Buffer

    from warmlink.ep.paths import setup as _setup

    if rank == num_ranks - 1:
        _setup.host_id = lambda: 12345  # another machine's
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{case['dist_port']}", rank=rank, world_size=num_ranks,
                            timeout=datetime.timedelta(seconds=30))
    try:
        with Buffer.from_group(max_tokens_per_rank=4, hidden=64, num_topk=2, backend="shm", timeout_s=30):
            return "built"
    except Exception as exc:  # noqa: BLE001 - the test compares the type name
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()


def _routed_everywhere(idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``idx`` with token 0 sent to an expert on every rank (its copies then sit at row 0 of every
    slot, where the index of an absent copy lands)."""
    idx = idx.clone()
    epr = num_experts // num_ranks
    idx[0, :num_ranks] = torch.arange(num_ranks) * epr
    return idx


def poisoned_rounds(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """Dispatch + combine rounds of the same inputs: clean, then with ``case["poisons"]`` (NaN,
    inf) written into channel 5 of token 0's row of x and into its first weight on rank 0. Returns
    this rank's combined outputs per round."""
    mine = case_inputs(case)[rank]
    x, w = mine["x"], mine["topk_weights"]
    idx = _routed_everywhere(mine["topk_idx"], case["experts"], num_ranks)
    out = []
    with _buffer(rank, num_ranks, store, case) as buf:
        for poison in (None, *case["poisons"]):
            xp, wp = x.clone(), w.clone()
            if poison is not None and rank == 0:
                xp[0, 5], wp[0, 0] = poison, poison
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(xp, topk_idx=idx, topk_weights=wp, num_experts=case["experts"])
            combined_x, combined_w, _ = buf.combine(recv_x.clone(), handle, topk_weights=recv_w)
            out.append({"combined_x": _cpu(combined_x), "combined_w": _cpu(combined_w)})
    return out


def disagree_then_agree(rank: int, num_ranks: int, store, case: dict) -> dict:
    """One call where rank 1 differs from the others as ``case["disagree"]`` says (x's dtype or
    ``topk_weights`` of a fresh or cached dispatch or of a combine), then the same round made alike
    on every rank. Returns what the differing call raised here and the round's outputs, in
    ``dispatch_combine``'s form."""
    mine = case_inputs(case)[rank]
    x, idx, w, kind = mine["x"], mine["topk_idx"], mine["topk_weights"], case["disagree"]
    odd = rank == 1
    error = "ok"

    def attempt(call) -> None:
        nonlocal error
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test compares the type name
            error = f"{type(exc).__name__}: {exc}"

    with _buffer(rank, num_ranks, store, case) as buf:
        fresh = {"topk_idx": idx, "num_experts": case["experts"]}
        if kind == "x_dtype":
            attempt(lambda: buf.dispatch(x.half() if odd else x, topk_weights=w, **fresh))
        if kind == "dispatch_weights":
            attempt(lambda: buf.dispatch(x, topk_weights=None if odd else w, **fresh))
        recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buf.dispatch(x, topk_weights=w, **fresh)
        got = {"recv_x": _cpu(recv_x), "recv_topk_idx": _cpu(recv_idx), "recv_topk_weights": _cpu(recv_w),
               "num_recv_tokens_per_expert_list": per_expert_list, "num_recv_tokens": handle.num_recv_tokens}
        if kind == "cached_x_dtype":
            attempt(lambda: buf.dispatch(x.half() if odd else x, handle=handle))
            got["cached_x"] = [_cpu(buf.dispatch(x, handle=handle)[0])]
        y = recv_x.clone()
        if kind == "combine_dtype":
            attempt(lambda: buf.combine(y.half() if odd else y, handle, topk_weights=recv_w))
        if kind == "combine_weights":
            attempt(lambda: buf.combine(y, handle, topk_weights=None if odd else recv_w))
        if kind == "combine_weight_columns":
            attempt(lambda: buf.combine(y, handle, topk_weights=recv_w[:, :1] if odd else recv_w))
        combined_x, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        got.update(combined_x=_cpu(combined_x), combined_w=_cpu(combined_w), y=_cpu(y))
    return {"error": error, "got": got}


def gathered_ints(rank: int, num_ranks: int, store, case: dict) -> dict:
    """``Buffer.all_gather_int`` many times in a row, rank 1 late every few meets; then a refused
    value, and a meet that rank 0 calls alone (its peers stop): what each raised; last rank 0 waits
    for that meet again and the peers join it late."""
    import random
    import time

    from warmlink.ep import Buffer
    from warmlink.errors import ConfigError, PeerLostError, TransferTimeout

    out: dict = {"wrong": []}
    buf = Buffer(store, rank, num_ranks, max_tokens_per_rank=4, hidden=8, num_topk=2, backend="shm", timeout_s=10)
    rng = random.Random(rank)
    for i in range(case["meets"]):
        if rank == 1 and i % 7 == 0:
            time.sleep(rng.uniform(0, 0.01))
        got = buf.all_gather_int(1000 * i + rank)
        if got != [1000 * i + r for r in range(num_ranks)]:
            out["wrong"].append((i, got))
    try:
        buf.all_gather_int(-1)
    except ConfigError as exc:
        out["refused"] = str(exc)
    if rank == 0:
        try:
            buf.all_gather_int(5, timeout_s=1.0)
            out["alone"] = "returned"
        except (TransferTimeout, PeerLostError) as exc:
            out["alone"] = type(exc).__name__
        # the same meet once more (a streamed Buffer's clear retries so): the peers join it late
        out["again"] = buf._normal.rounds.all_gather_int(0, 10.0, again=True)
    else:
        time.sleep(case["linger_s"])  # alive but not meeting: rank 0 must time out, not hang
        out["again"] = buf.all_gather_int(7 + rank)
    buf.close()
    return out


def returns_at_launch(rank: int, num_ranks: int, store, case: dict) -> dict:
    """After one round that every rank runs at once (a kernel's first launch loads its module, which
    CUDA may hold until the device is idle), rank 0 launches a cached dispatch and a combine before
    any peer calls either (the peers wait for its word in the store): neither may wait for a peer on
    the host. Returns this rank's outputs of those calls and of the warm-up round."""
    mine = case_inputs(case)[rank]
    device = rank_device(rank, case)
    x, idx = _to(mine["x"], device), mine["topk_idx"].to(device)
    with _buffer(rank, num_ranks, store, case) as buf:
        fresh = buf.dispatch(x, topk_idx=idx, num_experts=case["experts"])
        handle, y = fresh[4], fresh[0].clone()
        out = {"fresh": _cpu(fresh[0]), "cached_together": _cpu(buf.dispatch(x, handle=handle)[0]),
               "combined_together": _cpu(buf.combine(y, handle)[0])}
        if rank:
            store.wait_until(lambda: store.add("rank 0 returned", 0, checked=False) >= 1, what="rank 0's calls",
                             timeout_s=case.get("timeout_s", 30.0))
        cached = buf.dispatch(x, handle=handle)[0]
        combined = buf.combine(y, handle)[0]
        if not rank:
            store.add("rank 0 returned", 1, checked=False)
        out.update(cached=_cpu(cached), combined=_cpu(combined))
    return out


@contextlib.contextmanager
def _held(stream: int):
    """Hold ``stream`` (a raw CUDA stream) on a host word until the block ends: a stream wait no
    kernel ends. Yields the release, which the block may call earlier."""
    import ctypes
    import mmap

    from warmlink import _cuda

    page = mmap.mmap(-1, mmap.PAGESIZE)  # a page of its own: registering it touches no other allocation
    view = ctypes.c_int64.from_buffer(page)
    address = ctypes.addressof(view)
    del view  # the page stays mapped (and the address valid) until it is closed

    def release() -> None:
        page[:8] = (1).to_bytes(8, "little")  # one byte changes: the stream never reads a torn word

    try:
        _cuda.stream_wait_value(stream, _cuda.host_register(address, 8), 1)
        yield release
    finally:
        release()
        torch.cuda.synchronize()
        _cuda.host_unregister(address)
        page.close()


def runs_on_the_comm_stream(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Calls made with ``async_finish=True`` run on the Buffer's communication stream (ep.paths.comm_stream,
    Note [Communication stream]). With that stream held on a host word (a stream wait no kernel
    ends), a cached dispatch and a combine still return, the caller's stream runs past them, and
    their events stay unreached until the word is stored. Returns the outputs of each call made
    with and without ``async_finish`` (a fresh dispatch too, after a ``previous_event``), and what
    was seen while the stream was held."""
    from warmlink import _cuda

    mine = _mine_on_device(rank, case)
    x, idx, w, experts = mine["x"], mine["topk_idx"], mine["topk_weights"], case["experts"]
    with _buffer(rank, num_ranks, store, case) as buf:
        fresh = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts)
        handle, y = fresh[4], fresh[0].clone()
        out = {"fresh": _cpu(fresh[:3]), "cached": _cpu(buf.dispatch(x, handle=handle)[0]),
               "combined": _cpu(buf.combine(y, handle)[0])}
        before = torch.cuda.Event()
        before.record()
        again = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, previous_event=before,
                             async_finish=True)
        again[5].current_stream_wait()
        out["fresh_async"] = _cpu(again[:3])
        with _held(buf.get_comm_stream().cuda_stream) as release:
            cached = buf.dispatch(x, handle=handle, async_finish=True)
            combined = buf.combine(y, handle, async_finish=True)
            _caller_runs_on()
            out["held"] = [_cuda.event_query(cached[5].event), _cuda.event_query(combined[2].event)]
            release()
            cached[5].current_stream_wait()
            combined[2].current_stream_wait()
            out.update(cached_async=_cpu(cached[0]), combined_async=_cpu(combined[0]))
    return out


def _caller_runs_on() -> None:
    """Fail unless the caller's stream reaches an event recorded now (it is not held behind another stream)."""
    mark = torch.cuda.Event()
    mark.record()
    deadline = time.monotonic() + 60
    while not mark.query():
        assert time.monotonic() < deadline, "the caller's stream waited for the communication stream"
        time.sleep(0.001)


def padded_returns_at_launch(rank: int, num_ranks: int, store, case: dict) -> dict:
    """A fresh dispatch with ``num_worst_tokens`` returns at launch (ep.protocol.normal, Note [Padded
    dispatch returns at launch]): with the stream it runs on held on a host word, so that no
    kernel of it (nor the count exchange of any rank) can run, it still returns, its handle
    pending; once released, the combine (which resolves the handle) and every output equal the
    same calls made unheld. Held first: the caller's stream; then, with ``async_finish``, the
    communication stream, while the caller's stream runs on. The calls before warm both parities
    up (the first call of a shape runs eagerly and makes tables, the second captures its graphs)."""
    from warmlink import _cuda

    mine = _mine_on_device(rank, case)
    x, idx, w, experts, worst = mine["x"], mine["topk_idx"], mine["topk_weights"], case["experts"], case["worst"]

    def call(**kw):
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, num_worst_tokens=worst, **kw)

    def finish(d, **kw):
        if kw.get("async_finish"):
            d[5].current_stream_wait()
        c = buf.combine(d[0].clone(), d[4], topk_weights=d[2], **kw)
        if kw.get("async_finish"):
            c[2].current_stream_wait()
        return {"dispatched": _cpu(d[:3]), "combined": _cpu(c[:2]), "num_recv_tokens": d[4].num_recv_tokens}

    out = {}
    with _buffer(rank, num_ranks, store, case) as buf:
        for _ in range(4):
            out["unheld"] = finish(call())
        with _held(torch.cuda.current_stream().cuda_stream) as release:
            d = call()
            out["held_caller"] = [d[4].pending is not None, torch.cuda.current_stream().query()]
            release()
            out["caller"] = finish(d)
        finish(call(async_finish=True), async_finish=True)  # leases the communication stream
        with _held(buf.get_comm_stream().cuda_stream) as release:
            d = call(async_finish=True)
            _caller_runs_on()
            out["held_comm"] = [d[4].pending is not None, _cuda.event_query(d[5].event)]
            release()
            out["comm"] = finish(d, async_finish=True)
    return out


def calls_keep_their_order(rank: int, num_ranks: int, store, case: dict) -> dict:
    """A call on another stream than the last call's runs after it on the device (ep.paths.comm_stream,
    Note [Communication stream]). An async fresh dispatch of ``x`` whose push is held on a host word
    (its count exchange ran, so its host returned), then a padded fresh dispatch of ``-x`` on the
    caller's stream, which rewrites the device words that push reads; released, the async
    dispatch's outputs are still ``x``'s. The calls before warm both parities up, so that the
    held calls replay graphs. Returns both calls' outputs and the same calls' unheld."""
    mine = _mine_on_device(rank, case)
    x, idx, w, experts, worst = mine["x"], mine["topk_idx"], mine["topk_weights"], case["experts"], case["worst"]

    def call(tokens, **kw):
        return buf.dispatch(tokens, topk_idx=idx, topk_weights=w, num_experts=experts, **kw)

    out = {}
    with _buffer(rank, num_ranks, store, case) as buf:
        for _ in range(4):
            first = call(x, async_finish=True)
            first[5].current_stream_wait()
            out["unheld_first"] = _cpu(first[:3])
            second = call(-x, num_worst_tokens=worst)
            out["unheld_second"], out["unheld_n"] = _cpu(second[:3]), second[4].num_recv_tokens
        mover, launch = buf._mover, buf._mover._launch
        with contextlib.ExitStack() as stack:
            held = []

            def launch_held(key, steps, graphs):  # the push waits on a host word; the exchange before it runs
                if key[0] == "push" and not held:
                    held.append(stack.enter_context(_held(mover._current())))
                launch(key, steps, graphs)

            mover._launch = launch_held
            try:
                first = call(x, async_finish=True)
            finally:
                del mover._launch
            assert held, "the async dispatch launched no push"
            second = call(-x, num_worst_tokens=worst)
            out["second_pending"] = second[4].pending is not None
            held[0]()
            first[5].current_stream_wait()
            out["first"], out["second"], out["n"] = _cpu(first[:3]), _cpu(second[:3]), second[4].num_recv_tokens
    return out
