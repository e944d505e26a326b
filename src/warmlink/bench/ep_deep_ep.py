"""``warmlink bench ep --deep-ep``: DeepEP's normal-mode calls through the drop-in
(``warmlink.ep.deep_ep``) and, where a real DeepEP is importable (``import deep_ep`` finds its
compiled extension), through DeepEP itself, on the same inputs in the same run: the same-run
baseline every ep figure stands beside.

Both run DeepEP's API as DeepEP code calls it: a fresh dispatch is ``get_dispatch_layout`` then
``dispatch``, FP8 tokens come as ``(values, scales)`` with the scales column-major (as DeepEP's
tests pass them), a padded dispatch passes ``num_worst_tokens``, a cached one the handle, a
combine the handle and the received weights. Each is timed with two clocks from the same samples:
CUDA events on the caller's stream around the call (DeepEP's own tests' clock) and the host from
the call until the device finished (the slowest rank's median makes the table). Two budgets:
DeepEP's hint (``Config.get_nvl_buffer_size_hint`` of its recommended configs, as Megatron and
SGLang size it) and ``LARGE_BYTES``. On GPUs with ``gemm`` also how much of a GEMM already queued
an async combine of the drop-in hides (``previous_event``). Runs in the bench's rank processes
over their ``torch.distributed`` world, after the ep Buffer's timings.
"""

from __future__ import annotations

__all__ = ["BUDGETS", "BUDGET_NAMES", "CALLS", "LARGE_BYTES", "real_deep_ep", "time_deep_ep"]

BUDGETS = ("hint", "large")
LARGE_BYTES = int(2e9)  # what DeepEP's tests pass; one round for warmlink at the bench's default shapes
BUDGET_NAMES = {"hint": "hint budget", "large": "2e9 budget"}
CALLS = ("fresh_bf16", "fresh_fp8", "padded_bf16", "cached_bf16", "cached_fp8", "combine_bf16")


def real_deep_ep():
    """DeepEP itself when ``import deep_ep`` finds it with its extension (not warmlink's drop-in
    under that name), else None."""
    import importlib
    import sys

    try:
        module = importlib.import_module("deep_ep")
    except ImportError:
        return None
    if module is sys.modules.get("warmlink.ep.deep_ep") or not hasattr(module, "Buffer") or "deep_ep_cpp" not in sys.modules:
        return None
    return module


def time_deep_ep(module, x, topk_idx, weights, num_experts: int, clocks, gemm: int = 0) -> dict:
    """Per budget: its bytes, the rounds a warmlink call takes (1 for DeepEP) and per call of
    ``CALLS`` the ``clocks(fn)`` pair ``{"host": s, "events": s or None}``. ``module`` is a
    ``deep_ep`` (DeepEP's or ``warmlink.ep.deep_ep``). Collective over the default group."""
    import torch
    import torch.distributed as dist

    from warmlink.ep.wire.fp8 import quantize

    num_ranks, (num_tokens, hidden) = dist.get_world_size(), x.shape
    hint = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks)
               for c in (module.Buffer.get_dispatch_config(num_ranks), module.Buffer.get_combine_config(num_ranks)))
    values, scales = quantize(x)
    x8 = (values, scales.T.contiguous().T)  # column-major scales, as DeepEP's tests pass them
    topk_idx, out = topk_idx.to(module.topk_idx_t), {}
    ours = module.__name__.startswith("warmlink.")
    for name, budget in zip(BUDGETS, (hint, LARGE_BYTES)):
        buf = module.Buffer(dist.group.WORLD, budget, explicitly_destroy=True)
        try:
            def fresh(tokens, **extra):
                lay = buf.get_dispatch_layout(topk_idx, num_experts)
                return buf.dispatch(tokens, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1],
                                    is_token_in_rank=lay[3], num_tokens_per_expert=lay[2], topk_idx=topk_idx,
                                    topk_weights=weights, **extra)

            recv_x, _, recv_w, _, handle, _ = fresh(x)
            handle8 = fresh(x8)[4]
            rounds = getattr(handle, "rounds", None) if ours else None
            out[name] = {"budget": budget, "rounds": len(rounds) if rounds is not None else 1,
                         "fresh_bf16": clocks(lambda: fresh(x)),
                         "fresh_fp8": clocks(lambda: fresh(x8)),
                         # its rounds come from num_worst_tokens: no host meets the peers first
                         "padded_bf16": clocks(lambda: fresh(x, num_worst_tokens=num_ranks * num_tokens)),
                         "cached_bf16": clocks(lambda: buf.dispatch(x, handle=handle)),
                         "cached_fp8": clocks(lambda: buf.dispatch(x8, handle=handle8)),
                         "combine_bf16": clocks(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))}
            if ours and name == "large" and gemm and x.is_cuda:
                out[name]["overlap"] = _overlap(buf, recv_x, handle, recv_w, gemm, x.device, clocks,
                                                out[name]["combine_bf16"])
        finally:
            dist.barrier()  # every rank is past its last call before any rank's buffer goes
            buf.destroy()
            torch.cuda.synchronize() if x.is_cuda else None
    return out


def _overlap(buf, recv_x, handle, recv_w, gemm: int, device, clocks, combine_alone) -> dict:
    """The GEMM alone, the combine then the GEMM, and the GEMM queued first with the combine made
    beside it (``previous_event`` captured before the GEMM, ``async_finish``)."""
    import torch

    a, b = (torch.randn(gemm, gemm, device=device, dtype=torch.bfloat16) for _ in range(2))

    def combine(**kw):
        return buf.combine(recv_x, handle, topk_weights=recv_w, **kw)

    def beside() -> None:
        before = buf.capture()  # the combine's inputs are ready here; the GEMM is not its input
        a @ b
        combine(previous_event=before, async_finish=True)[2].current_stream_wait()

    return {"gemm": clocks(lambda: a @ b), "combine": combine_alone,
            "combine_then_gemm": clocks(lambda: (combine(), a @ b)), "gemm_beside": clocks(beside)}
