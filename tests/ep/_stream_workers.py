"""The streamed dispatch's test inputs (interpreted_stream.py, test_stream_gpu.py) and its GPU rank
scenarios, run by ``_group.run_ranks``: each rank maps its peers' stream spaces over CUDA IPC
(warmlink.transport's cuda_ipc link) and launches ep.kernels.stream's kernel.

Every rank builds every rank's inputs from the call's seed, so each one computes its own expected
rows with the torch twin (``stream_dispatch_torch``) and checks them itself: nothing large travels
back to the parent.
"""

from __future__ import annotations

import contextlib
import json
import time

import torch

from tests.ep._reference import random_routing
from tests.ep._workers import scales_laid_out
from warmlink.ep.kernels import steps
from warmlink.ep.kernels.layout import dispatch_layout
from warmlink.ep.kernels.stream import Sources, StreamSpace, failures, outputs, recv_offsets, stream_dispatch
from warmlink.ep.kernels.stream import stream_dispatch_torch
from warmlink.ep.wire.fp8 import num_scales


def group_inputs(call: dict, num_ranks: int) -> tuple[list, list, list]:
    """Every rank's ``(plan rows, Sources, raw)`` of ``call`` on the CPU: ``raw`` holds x in its own
    dtype (an FP8 tuple with the scales) and the routing, for the oracle (tests.ep._reference).

    call keys: seed, tokens (per rank), hidden, experts, topk, dtype (bf16 or float8_e4m3fn),
    layout of the FP8 scales ("row", "column"), weights (default True), mask_prob, max_tokens."""
    experts, k, hidden = call["experts"], call["topk"], call["hidden"]
    max_tokens = call.get("max_tokens", max(call["tokens"]) or 1)
    fp8 = call.get("dtype", torch.bfloat16) == torch.float8_e4m3fn
    rows_of, sources_of, raw = [], [], []
    for s, tokens in enumerate(call["tokens"]):
        gen = torch.Generator().manual_seed(call["seed"] * 1000 + s)
        topk = random_routing(tokens, experts, k, gen, call.get("mask_prob", 0.2))
        weights = torch.rand(tokens, k, generator=gen) if call.get("weights", True) else None
        x = torch.randn(tokens, hidden, generator=gen).to(call.get("dtype", torch.bfloat16))
        scales = torch.rand(tokens, num_scales(hidden), generator=gen) + 0.5 if fp8 else None
        lay = dispatch_layout(topk, experts, num_ranks)
        rows, _ = steps.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, max_tokens)
        rows_of.append(rows)
        laid = scales_laid_out(scales, call.get("layout", "row")) if fp8 else None
        sources_of.append(Sources(x.view(torch.int64), topk, weights, laid))
        raw.append({"x": (x, scales) if fp8 else x, "topk_idx": topk, "topk_weights": weights})
    return rows_of, sources_of, raw


def same_bits(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    """Equal bit for bit (float parts compared as integers), or both None."""
    if got is None or want is None:
        return got is None and want is None
    as_int = {4: torch.int32, 8: torch.int64}.get(want.element_size())
    got, want = got.cpu(), want.cpu()
    if want.is_floating_point() and as_int is not None:
        got, want = got.view(as_int), want.view(as_int)
    return got.shape == want.shape and torch.equal(got, want)


def expert_output(words: torch.Tensor, hidden: int, rank: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Rank ``rank``'s expert output for the BF16 (or FP16) rows it received (``[N, W]`` int64 words):
    the rows times 2, -0.5, 1 or 4 by rank, exact in either, so that the device's and the CPU's
    agree and the sums tell the ranks apart."""
    return words.view(dtype).view(words.shape[0], hidden) * (2.0, -0.5, 1.0, 4.0)[rank % 4]


@contextlib.contextmanager
def mapped_spaces(rank: int, num_ranks: int, store, nbytes: int, device: int, timeout_s: float):
    """This rank's zeroed stream space and every peer's, mapped here: yields ``[R]`` int64 byte
    addresses on the device. Leaves only after every rank said it is done (no peer still writes)."""
    from warmlink.transport import lease_link
    from warmlink.transport.base import PeerRef, local_identity

    lease = lease_link("cuda_ipc", device, timeout_s)
    link, opened, region = lease.resource, [], None
    try:
        region = link.allocate(nbytes)
        region.tensor.zero_()
        torch.cuda.synchronize(device)  # zero before any peer can see it
        host, pid, start = local_identity()
        store.set(f"stream/{rank}", json.dumps({"desc": region.desc, "host": host, "pid": pid, "start": start}))
        ptrs = []
        for r in range(num_ranks):
            if r == rank:
                ptrs.append(region.ptr)
                continue
            info = json.loads(store.get(f"stream/{r}", timeout_s=timeout_s))
            ref = PeerRef(f"{store.prefix}:stream/{r}", 1, info["host"], info["pid"], info["start"])
            remote = link.open(ref, info["desc"])
            opened.append(remote)
            ptrs.append(remote.ptr)
        yield torch.tensor(ptrs, dtype=torch.int64, device=device)
        barrier(store, "stream/end", rank, num_ranks, timeout_s)
    finally:
        for remote in opened:
            link.close_region(remote)
        if region is not None:
            link.release(region)
        lease.release()


def barrier(store, name: str, rank: int, num_ranks: int, timeout_s: float) -> None:
    store.set(f"{name}/{rank}", b"1")
    for r in range(num_ranks):
        store.get(f"{name}/{r}", timeout_s=timeout_s)


def stream_calls(rank: int, num_ranks: int, store, case: dict) -> dict:
    """``case["calls"]`` streamed dispatches (seq 1, 2, ...) through one space of ``case``'s channels
    and ring rows; ``case["dead"]``: a rank that maps its space and never launches. Returns, per
    call, whether each output equals the torch twin's bit for bit, the failures and the seconds
    from launch to the end of the kernel."""
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    space = StreamSpace(num_ranks, case["channels"], case["ring_rows"], case["row_words"])
    experts_per_rank = case["calls"][0]["experts"] // num_ranks
    results = []
    with mapped_spaces(rank, num_ranks, store, space.nbytes, device, case.get("store_timeout_s", 120.0)) as bases:
        for seq, call in enumerate(case["calls"], start=1):
            rows_of, sources_of, _ = group_inputs(call, num_ranks)
            max_tokens = call.get("max_tokens", max(call["tokens"]) or 1)
            want = stream_dispatch_torch(rank, rows_of, sources_of, max_tokens, experts_per_rank)
            offsets, total = recv_offsets([int((r[:, rank] >= 0).sum()) for r in rows_of], dev)
            src = sources_of[rank]
            src = Sources(*(t.to(dev) if t is not None else None for t in (src.x, src.topk, src.weights)),
                          scales_laid_out(src.scales.contiguous().to(dev), call.get("layout", "row"))
                          if src.scales is not None else None)
            out = outputs(total, src)
            for part in out:
                if part is not None:
                    part.fill_(-7)
            status = torch.zeros(2 * space.channels, dtype=torch.int64, device=dev)
            barrier(store, f"stream/launch/{seq}", rank, num_ranks, 120.0)
            if rank == case.get("dead") and seq > 1:  # call 1 runs everywhere (it compiles the kernel)
                results.append({"dead": True})
                continue
            start = time.monotonic()
            stream_dispatch(space, rows_of[rank].to(dev), src, out, offsets, bases, status, me=rank, seq=seq,
                            max_tokens=max_tokens, experts_per_rank=experts_per_rank,
                            timeout_s=call.get("timeout_s", case["timeout_s"]), kernel=case.get("kernel"),
                            **case.get("steps", {}))
            torch.cuda.synchronize(device)  # bounded: every wait of the kernel has its deadline
            elapsed = time.monotonic() - start
            same = {name: same_bits(got, exp) for name, got, exp in zip(out._fields, out, want)}
            results.append({"same": same, "failures": [f._asdict() for f in failures(status, seq, space.channels)],
                            "seconds": elapsed, "rows": total})
    return results


def _twin_side(rank: int, num_ranks: int, call: dict, channels: int):
    """What the combine's twin needs from every rank d, from the call's seed: ``(plan rows, ys, taken,
    offsets, weights or None)``, ys the expert outputs (``expert_output``) of d's dispatch rows."""
    rows_of, sources_of, _ = group_inputs(call, num_ranks)
    max_tokens, epr = call.get("max_tokens", max(call["tokens"]) or 1), call["experts"] // num_ranks
    ys, taken_of, offsets_of, ws = [], [], [], []
    for d in range(num_ranks):
        taken = torch.zeros(num_ranks, channels, dtype=torch.int64)
        got = stream_dispatch_torch(d, rows_of, sources_of, max_tokens, epr, taken=taken)
        ys.append(expert_output(got.x, call["hidden"], d, call.get("dtype", torch.bfloat16)))
        taken_of.append(taken)
        offsets_of.append(recv_offsets([int((r[:, d] >= 0).sum()) for r in rows_of])[0])
        ws.append(got.weights)
    return rows_of, sources_of, ys, taken_of, offsets_of, ws if call.get("weights", True) else None


def stream_round_trips(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Per call of ``case["calls"]``, a streamed dispatch (seq 2i + 1) then a streamed combine (2i + 2)
    of ``expert_output`` of the rows received, through one space. Returns, per call, whether the
    dispatch's outputs and ``taken`` and the combine's sums equal the twins' bit for bit, the failures
    of both launches and the seconds each took."""
    from warmlink.ep.kernels.stream_combine import stream_combine, stream_combine_torch

    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    space = StreamSpace(num_ranks, case["channels"], case["ring_rows"], case["row_words"])
    results = []
    with mapped_spaces(rank, num_ranks, store, space.nbytes, device, case.get("store_timeout_s", 120.0)) as bases:
        for i, call in enumerate(case["calls"]):
            seq, timeout_s = 2 * i + 1, call.get("timeout_s", case["timeout_s"])
            rows_of, sources_of, ys, taken_of, offsets_of, ws = _twin_side(rank, num_ranks, call, space.channels)
            max_tokens = call.get("max_tokens", max(call["tokens"]) or 1)
            mine = sources_of[rank]
            src = Sources(*(t.to(dev) if t is not None else None for t in (mine.x, mine.topk, mine.weights)))
            offsets, total = recv_offsets([int((r[:, rank] >= 0).sum()) for r in rows_of], dev)
            out = outputs(total, src)
            taken = torch.full((num_ranks, space.channels), -7, dtype=torch.int64, device=dev)
            status = torch.zeros(2 * space.channels, dtype=torch.int64, device=dev)
            rows = rows_of[rank].to(dev)
            barrier(store, f"stream/launch/{seq}", rank, num_ranks, 120.0)
            start = time.monotonic()
            stream_dispatch(space, rows, src, out, offsets, bases, status, me=rank, seq=seq, max_tokens=max_tokens,
                            experts_per_rank=call["experts"] // num_ranks, timeout_s=timeout_s, taken=taken,
                            kernel=case.get("kernel"))
            torch.cuda.synchronize(device)
            dispatch_s = time.monotonic() - start
            fails = [f._asdict() for f in failures(status, seq, space.channels)]
            dtype = call.get("dtype", torch.bfloat16)  # BF16 or FP16: the combine sums either
            y = expert_output(out.x, call["hidden"], rank, dtype)
            w = out.weights if ws is not None else None
            summed = torch.full((rows.shape[0], call["hidden"]), 7.0, dtype=dtype, device=dev)
            summed_w = torch.full((rows.shape[0], call["topk"]), 7.0, device=dev) if w is not None else None
            status = torch.zeros(2 * space.channels, dtype=torch.int64, device=dev)
            start = time.monotonic()
            stream_combine(space, rows, y, summed, taken, offsets, bases, status, me=rank, seq=seq + 1,
                           timeout_s=timeout_s, weights=w, out_weights=summed_w, kernel=case.get("kernel"))
            torch.cuda.synchronize(device)
            combine_s = time.monotonic() - start
            fails += [f._asdict() for f in failures(status, seq + 1, space.channels)]
            want, want_w = stream_combine_torch(rank, rows_of[rank], ys, taken_of, offsets_of, ws)
            same = {"dispatch x (as the expert output)": same_bits(y, ys[rank]),
                    "taken": same_bits(taken, taken_of[rank]),
                    "combine": same_bits(summed, want), "combine weights": same_bits(summed_w, want_w)}
            results.append({"same": same, "failures": fails, "dispatch_s": dispatch_s, "combine_s": combine_s,
                            "rows": total, "tokens": rows.shape[0]})
    return results
