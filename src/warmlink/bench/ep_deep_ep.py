"""``warmlink bench ep --deep-ep``: DeepEP's normal-mode calls through the drop-in
(``warmlink.ep.deep_ep``) and, where a real DeepEP is importable (``import deep_ep`` finds its
compiled extension), through DeepEP itself, on the same inputs in the same run: the same-run
baseline every ep figure stands beside.

Both run DeepEP's API as DeepEP code calls it: a fresh dispatch is ``get_dispatch_layout`` then
``dispatch``, FP8 tokens come as ``(values, scales)`` with the scales column-major (as DeepEP's
tests pass them), a padded dispatch passes ``num_worst_tokens``, a cached one the handle, a
combine the handle and the received weights. Each is timed with two clocks from the same samples:
CUDA events on the caller's stream around the call (DeepEP's own tests' clock) and the host from
the call until the device finished (the slowest rank's median makes the table); the two codes'
samples of a call are taken in turn, so that a host whose speed drifts moves both. Two budgets:
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


class _Code:
    """One ``deep_ep`` module's Buffer of a budget and the calls ``time_deep_ep`` times on it."""

    def __init__(self, module, budget: int, x, x8, topk_idx, weights, num_experts: int) -> None:
        import torch.distributed as dist

        self.ours = module.__name__.startswith("warmlink.")
        self.buf = buf = module.Buffer(dist.group.WORLD, budget, explicitly_destroy=True)
        self.topk_idx, self.weights, self.num_experts = topk_idx.to(module.topk_idx_t), weights, num_experts
        self.recv_x, _, self.recv_w, _, self.handle, _ = self.fresh(x)
        self.handle8 = self.fresh(x8)[4]
        rounds = getattr(self.handle, "rounds", None) if self.ours else None
        self.rounds = len(rounds) if rounds is not None else 1
        worst = dist.get_world_size() * x.shape[0]
        self.calls = {"fresh_bf16": lambda: self.fresh(x), "fresh_fp8": lambda: self.fresh(x8),
                      # its rounds come from num_worst_tokens: no host meets the peers first
                      "padded_bf16": lambda: self.fresh(x, num_worst_tokens=worst),
                      "cached_bf16": lambda: buf.dispatch(x, handle=self.handle),
                      "cached_fp8": lambda: buf.dispatch(x8, handle=self.handle8),
                      "combine_bf16": lambda: buf.combine(self.recv_x, self.handle, topk_weights=self.recv_w)}

    def fresh(self, tokens, **extra):
        lay = self.buf.get_dispatch_layout(self.topk_idx, self.num_experts)
        return self.buf.dispatch(tokens, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1],
                                 is_token_in_rank=lay[3], num_tokens_per_expert=lay[2], topk_idx=self.topk_idx,
                                 topk_weights=self.weights, **extra)


def time_deep_ep(modules: list, x, topk_idx, weights, num_experts: int, clocks, gemm: int = 0) -> list[dict]:
    """Per code of ``modules`` (each a ``deep_ep``: DeepEP's or ``warmlink.ep.deep_ep``), per
    budget: its bytes, the rounds a warmlink call takes (1 for DeepEP) and per call of ``CALLS``
    the ``clocks`` pair ``{"host": s, "events": s or None}``. The codes' samples of a call are
    taken in turn (``clocks`` of a list), so that they see the same machine. Collective over the
    default group."""
    import torch
    import torch.distributed as dist

    from warmlink.ep.wire.fp8 import quantize

    num_ranks, hidden = dist.get_world_size(), x.shape[1]
    hint = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks)
               for m in modules for c in (m.Buffer.get_dispatch_config(num_ranks), m.Buffer.get_combine_config(num_ranks)))
    values, scales = quantize(x)
    x8 = (values, scales.T.contiguous().T)  # column-major scales, as DeepEP's tests pass them
    out: list[dict] = [{} for _ in modules]
    for name, budget in zip(BUDGETS, (hint, LARGE_BYTES)):
        codes: list[_Code] = []
        try:
            for module in modules:  # every rank builds them in the same order
                codes.append(_Code(module, budget, x, x8, topk_idx, weights, num_experts))
            for i, code in enumerate(codes):
                out[i][name] = {"budget": budget, "rounds": code.rounds}
            for call in CALLS:
                for i, timed in enumerate(clocks([code.calls[call] for code in codes])):
                    out[i][name][call] = timed
            ours = codes[0]
            if ours.ours and name == "large" and gemm and x.is_cuda:
                out[0][name]["overlap"] = _overlap(ours.buf, ours.recv_x, ours.handle, ours.recv_w, gemm, x.device,
                                                   clocks, out[0][name]["combine_bf16"])
        finally:
            dist.barrier()  # every rank is past its last call before any rank's buffer goes
            for code in codes:
                code.buf.destroy()
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
