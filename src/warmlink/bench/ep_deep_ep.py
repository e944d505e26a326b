"""``warmlink bench ep --deep-ep``: the DeepEP drop-in's calls (``warmlink.ep.deep_ep``) at the
bench's shapes, with DeepEP's own hint-sized budget, which holds fewer tokens than the batch, so
each call goes in several rounds (deep_ep.rounds, Note [Rounds beyond the budget]), beside a
budget that holds the batch in one round; on GPUs also how much of a GEMM already queued an
async combine hides (``previous_event``: the call does not wait for the caller's stream, unlike
``ep.Buffer``'s). Runs in the bench's rank processes, after the ep Buffer's timings, over their
``torch.distributed`` world."""

from __future__ import annotations

__all__ = ["BUDGETS", "BUDGET_NAMES", "time_deep_ep"]

BUDGETS = ("hint", "one_round")  # DeepEP's Config.get_nvl_buffer_size_hint; sizing.needed_bytes of the batch
BUDGET_NAMES = {"hint": "hint budget", "one_round": "batch budget"}


def time_deep_ep(x, topk_idx, weights, num_experts: int, timed, gemm: int = 0) -> dict:
    """Per budget: its bytes, the rounds a call takes, and the median seconds (``timed``) of a
    fresh dispatch, a padded one (``num_worst_tokens``), a cached one and a combine with weights. On CUDA with ``gemm`` (M=N=K of a
    BF16 GEMM), also ``"overlap"`` for the batch budget: the GEMM alone, the combine alone, the
    combine then the GEMM, and the GEMM queued first with the combine made beside it
    (``previous_event`` captured before the GEMM, ``async_finish``: DeepEP's way to overlap work
    already queued). Collective over the default group."""
    import torch
    import torch.distributed as dist

    import warmlink.ep.deep_ep as deep_ep
    from warmlink.ep.deep_ep.sizing import needed_bytes

    num_ranks, (num_tokens, hidden), num_topk = dist.get_world_size(), x.shape, topk_idx.shape[1]
    hint = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks)
               for c in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)))
    topk_idx, out = topk_idx.to(deep_ep.topk_idx_t), {}
    for name, budget in zip(BUDGETS, (hint, needed_bytes(num_tokens, num_ranks, hidden, num_topk))):
        with deep_ep.Buffer(dist.group.WORLD, budget) as buf:
            lay = buf.get_dispatch_layout(topk_idx, num_experts)
            kw = {"num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2],
                  "topk_idx": topk_idx, "topk_weights": weights}
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kw)
            out[name] = {"budget": budget, "rounds": len(handle.rounds) if handle.rounds is not None else 1,
                         "dispatch": timed(lambda: buf.dispatch(x, **kw)),
                         # its rounds come from num_worst_tokens: no host meets the peers first
                         "padded": timed(lambda: buf.dispatch(x, **kw, num_worst_tokens=num_ranks * num_tokens)),
                         "cached": timed(lambda: buf.dispatch(x, handle=handle)),
                         "combine": timed(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))}
            if name == "one_round" and gemm and x.is_cuda:
                a, b = (torch.randn(gemm, gemm, device=x.device, dtype=torch.bfloat16) for _ in range(2))

                def combine(**kw):
                    return buf.combine(recv_x, handle, topk_weights=recv_w, **kw)

                def beside() -> None:
                    before = buf.capture()  # the combine's inputs are ready here; the GEMM is not its input
                    a @ b
                    combine(previous_event=before, async_finish=True)[2].current_stream_wait()

                out[name]["overlap"] = {"gemm": timed(lambda: a @ b), "combine": out[name]["combine"],
                                        "combine_then_gemm": timed(lambda: (combine(), a @ b)), "gemm_beside": timed(beside)}
    return out
