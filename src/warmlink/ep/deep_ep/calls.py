"""How ``deep_ep.Buffer``'s dispatch and combine are carried out on the warmlink Buffer inside,
once their arguments are checked: in one round, or in several when the batch is larger than the
Buffer holds (deep_ep.rounds, Note [Rounds beyond the budget]); rows narrower than it padded to
its width and cut back (deep_ep.inner); with DeepEP's outputs (fresh tensors: a copy of the slots'
rows, the streamed Buffer's own; the packed UE8M0 scales given back; DeepEP's handle).
"""

from __future__ import annotations

import torch

from warmlink.ep.deep_ep import rounds
from warmlink.ep.deep_ep.handle import DispatchHandle
from warmlink.ep.deep_ep.inner import narrow, widen
from warmlink.ep.deep_ep.scales import unpack_scales
from warmlink.ep.wire.words import RefusedRound
from warmlink.errors import ConfigError

__all__ = ["cached", "combine", "fresh"]


def fresh(inner, group_size: int, tokens, packed: int, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
          topk_idx, topk_weights, expert_alignment: int, num_worst_tokens: int) -> tuple:
    """A fresh dispatch's ``(recv_x, recv_topk_idx, recv_topk_weights, per-expert list, handle)``."""
    tokens, width = widen(tokens, inner.layout.hidden)  # a narrower call: deep_ep.inner, Note [Built on first dispatch]
    rows = tokens[0] if isinstance(tokens, tuple) else tokens
    with_topk = topk_idx is not None
    if not with_topk:  # no expert ids travel: every row is routed by is_token_in_rank alone
        topk_idx = torch.full((rows.shape[0], 1), -1, dtype=torch.int64, device=rows.device)
    problem = rounds.argument_problem(rows.shape[0], group_size, is_token_in_rank, topk_idx, topk_weights,
                                      num_tokens_per_expert)
    if inner.send == "stream":  # any batch in one call: no rounds, and no meeting first
        num_rounds = 1
        if problem:
            inner.refuse_dispatch(problem)
    elif num_worst_tokens:  # no meeting first: a problem is refused in the round itself, on every rank
        num_rounds, too_many = rounds.padded_rounds(inner, num_worst_tokens, rows.shape[0])
        if problem or too_many:
            inner.refuse_dispatch(problem or too_many)
    elif problem or rows.shape[0] > inner.layout.max_tokens:  # one round, refused, then the meet (deep_ep.rounds)
        try:
            inner.refuse_dispatch(problem or f"deep_ep.Buffer.dispatch: {rows.shape[0]} tokens need rounds")
        except ConfigError:
            pass
        num_rounds = rounds.after_refused_round(inner, rows.shape[0], ConfigError(problem) if problem else None)
    else:  # one round, no meeting first: a refused one says whether a peer's batch needs more
        num_rounds = 1
    if num_rounds == 1:
        try:
            recv_x, recv_idx, recv_w, per_expert, inner_handle, _ = inner.dispatch(
                tokens, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        except ConfigError as exc:
            if inner.send == "stream" or num_worst_tokens:
                raise
            if isinstance(exc, RefusedRound) and inner.rank not in exc.ranks:  # a peer's: its batch may need rounds
                num_rounds = rounds.after_refused_round(inner, rows.shape[0], refused=exc)
            else:  # this rank's own arguments, refused in the round: its peers meet to hear it (raises exc)
                rounds.after_refused_round(inner, rows.shape[0], exc)
    if num_rounds > 1:
        recv_x, recv_idx, recv_w, per_expert, done, matrix = rounds.dispatch_rounds(
            inner, tokens, num_rounds, is_token_in_rank, topk_idx, topk_weights, num_tokens_per_expert,
            num_tokens_per_expert.numel(), with_topk, expert_alignment, num_worst_tokens)
        out = DispatchHandle.of_rounds(done, matrix, num_worst_tokens, is_token_in_rank, inner, rows.device)
        return (unpack_scales(narrow(recv_x, width)[0], packed, fresh=True), recv_idx if with_topk else None,
                recv_w if with_topk else None, per_expert, out)
    out = DispatchHandle.of(inner_handle, is_token_in_rank, inner, rows.device)
    if not with_topk:
        recv_idx = recv_w = None
    recv_x, cut = narrow(recv_x, width)
    return unpack_scales(recv_x, packed, fresh=cut or inner.fresh_outputs), recv_idx, recv_w, per_expert, out


def cached(inner, tokens, packed: int, handle: DispatchHandle, expert_alignment: int, num_worst_tokens: int) -> tuple:
    """A cached dispatch's ``(recv_x, None, None, None, None)``, as DeepEP's."""
    tokens, width = widen(tokens, inner.layout.hidden)
    if handle.rounds is not None:
        recv_x = rounds.dispatch_cached_rounds(inner, tokens, handle.rounds, handle.num_output_rows)
        return unpack_scales(narrow(recv_x, width)[0], packed, fresh=True), None, None, None, None
    recv_x, cut = narrow(inner.dispatch(tokens, handle=handle.inner, expert_alignment=expert_alignment,
                                        num_worst_tokens=num_worst_tokens)[0], width)
    return unpack_scales(recv_x, packed, fresh=cut or inner.fresh_outputs), None, None, None, None


def combine(inner, x: torch.Tensor, handle: DispatchHandle, topk_weights, biases: tuple) -> tuple:
    """``(combined_x, combined_topk_weights or None)`` with ``biases`` added (in float32, then
    rounded to x's dtype)."""
    x, width = widen(x, inner.layout.hidden)
    if handle.rounds is not None:
        out, out_w = rounds.combine_rounds(inner, x, topk_weights, handle.rounds, handle.num_tokens)
    else:
        out, out_w, _ = inner.combine(x, handle.inner, topk_weights=topk_weights)
    out = narrow(out, width)[0]
    if biases:
        out = sum((b.float() for b in biases), out.float()).to(out.dtype)
    return out, out_w
