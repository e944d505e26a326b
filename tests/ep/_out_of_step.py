"""Rank-side scenarios of ranks whose calls do not line up (tests/ep/test_out_of_step.py), over shm.

Each rank makes a few steps of dispatches (fresh or cached) and combines, and records for each
call what it raised or whether its outputs equal the oracle's for that step: a call may fail, but
none may return another step's rows.
"""

from __future__ import annotations

import time

import torch

from tests.ep._reference import random_routing, reference_dispatch, token_pattern
from tests.ep._workers import _buffer

TOKENS, HIDDEN, EXPERTS, TOPK = 4, 16, 6, 2


def step_inputs(step: int, num_ranks: int) -> tuple[list, list]:
    """Every rank's x and routing of ``step`` (rows distinct per step)."""
    xs, idxs = [], []
    for r in range(num_ranks):
        gen = torch.Generator().manual_seed(1000 * step + r)
        idxs.append(random_routing(TOKENS, EXPERTS, TOPK, gen))
        xs.append(token_pattern(r, TOKENS, HIDDEN, torch.bfloat16) + 64 * step)
    return xs, idxs


def _outcome(call, want: torch.Tensor | None = None) -> str:
    """``call()``'s error as ``"Type: message"``, else "ok" (its first output, recv_x or the combined
    rows, equal to ``want``) or "WRONG"."""
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 - the test compares the type and message
        return f"{type(exc).__name__}: {exc}"
    return "ok" if want is None or torch.equal(out[0], want) else "WRONG"


def out_of_step(rank: int, num_ranks: int, store, case: dict) -> list[str]:
    """``case["scenario"]``, then every rank's further steps; each call's outcome, in order."""
    scenario, log = case["scenario"], []
    with _buffer(rank, num_ranks, store, dict(case, tokens=[TOKENS] * num_ranks, hidden=HIDDEN, topk=TOPK)) as buf:
        def fresh(step: int):
            xs, idxs = step_inputs(step, num_ranks)
            want = reference_dispatch(xs, idxs, None, EXPERTS)[rank]["recv_x"]
            return want, lambda: buf.dispatch(xs[rank], topk_idx=idxs[rank], num_experts=EXPERTS)

        def cached(step: int, handle, rows: int = TOKENS):
            """A re-send of ``handle``'s dispatch (made at ``step``) with the next step's x."""
            xs, idxs = step_inputs(step, num_ranks)
            xs = [x + 1 for x in xs]
            want = reference_dispatch(xs, idxs, None, EXPERTS)[rank]["recv_x"]
            return want, lambda: buf.dispatch(xs[rank][:rows], handle=handle)

        if scenario == "other_handles":  # rank 0 re-sends the first dispatch's handle, the others the second's
            handles = [fresh(step)[1]()[4] for step in (0, 1)]
            step = 0 if rank == 0 else 1
            log.append(_outcome(cached(step, handles[step])[1]))
            want, call = cached(1, handles[1])
            log.append(_outcome(call, want))
        elif scenario == "refused_cached":  # rank 1 passes one token too few
            handle = fresh(0)[1]()[4]
            log.append(_outcome(cached(0, handle, rows=TOKENS - 1 if rank == 1 else TOKENS)[1]))
            want, call = cached(0, handle)
            log.append(_outcome(call, want))
        elif scenario == "foreign_handle":  # a handle of another Buffer of the same group
            with _buffer(rank, num_ranks, store, dict(case, tokens=[TOKENS] * num_ranks, hidden=HIDDEN,
                                                      topk=TOPK)) as other:
                xs, idxs = step_inputs(0, num_ranks)
                theirs = other.dispatch(xs[rank], topk_idx=idxs[rank], num_experts=EXPERTS)
                log.append(_outcome(cached(0, theirs[4])[1]))
                log.append(_outcome(lambda: buf.combine(theirs[0].clone(), theirs[4])))
        elif scenario == "refused_combine":  # rank 1 passes one row too few; then a combine of every rank's rows
            xs, idxs = step_inputs(0, num_ranks)
            out = buf.dispatch(xs[rank], topk_idx=idxs[rank], num_experts=EXPERTS)
            log.append(_outcome(lambda: buf.combine(out[0][:-1] if rank == 1 else out[0], out[4])))
            ranks = torch.stack([((idxs[rank] // (EXPERTS // num_ranks)) == r).any(1) for r in range(num_ranks)], 1)
            want = (xs[rank].float() * ranks.sum(1, keepdim=True)).to(torch.bfloat16)  # the sum of its copies
            log.append(_outcome(lambda: buf.combine(out[0], out[4]), want))
        elif scenario == "stall":  # rank 1 starts step 1's dispatch past the others' timeout
            for step in range(4):
                want, call = fresh(step)
                if rank == 1 and step == 1:
                    time.sleep(case["timeout_s"] * 1.7)
                log.append(_outcome(call, want))
            return log
        want, call = fresh(5)
        log.append(_outcome(call, want))  # the rounds are in step again
    return log
