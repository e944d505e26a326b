"""Rank-side scenarios of a streamed Buffer's failures (ep.protocol.streamed, Note [Streamed calls])."""

from __future__ import annotations

import time

import torch

from tests.ep._workers import _buffer, _cpu, _to, case_inputs, rank_device


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
