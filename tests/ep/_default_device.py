"""Rank-side scenario of the default-device tests: inputs made first, then the process's default
device and dtype set as DeepEP's test harness sets them, then a Buffer built and one dispatch +
combine round, so that every tensor the library makes without naming a device lands there."""

from __future__ import annotations

import torch

from tests.ep._workers import _buffer, _cpu, case_inputs, rank_device


def round_under_default_device(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """``case["default_device"]`` (and ``torch.bfloat16`` as the default dtype) set after the
    inputs are made; one dispatch + combine round; this rank's outputs in ``dispatch_combine``'s form."""
    mine = case_inputs(case)[rank]
    device = rank_device(rank, case)
    x, idx, w = mine["x"].to(device), mine["topk_idx"].to(device), mine["topk_weights"].to(device)
    torch.set_default_device(case["default_device"])
    torch.set_default_dtype(torch.bfloat16)
    try:
        with _buffer(rank, num_ranks, store, case) as buf:
            recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                           num_experts=case["experts"])
            y = recv_x.clone()
            out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w)
            return [{"recv_x": _cpu(recv_x), "recv_topk_idx": _cpu(recv_idx), "recv_topk_weights": _cpu(recv_w),
                     "num_recv_tokens_per_expert_list": per_expert, "num_recv_tokens": handle.num_recv_tokens,
                     "y": _cpu(y), "combined_x": _cpu(out), "combined_w": _cpu(out_w)}]
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
