"""Batches larger than the warmlink Buffer inside holds, sent in several rounds.

# Note [Rounds beyond the budget]
DeepEP streams any batch through rings that fit its byte budget. A warmlink Buffer holds a slot row
per token instead (ep.wire.regions). So ``deep_ep.Buffer`` builds the largest Buffer within the
budget (``sizing.tokens_within``: C tokens per rank) and sends a larger batch as several rounds of
at most C tokens from each rank: round k carries each rank's tokens ``[kC, (k+1)C)``, none for a
rank that has fewer. Every rank must run the same number of rounds, yet a host meet before every
fresh dispatch cost ~140 us on 2 x H200 for the batches that fit one round, nearly all of them. So a
fresh dispatch first tries one round without meeting anyone: a rank whose batch fits sends it; a
rank with more than C tokens, or whose arguments are wrong, takes part refused
(``ep.Buffer.refuse_dispatch``), which refuses the round on every rank alike (each peer raises
``RefusedRound``). Only after a refused round do the ranks meet (``after_refused_round``: every
rank's token count through ``ep.Buffer.all_gather_int``, host mailboxes, no kernel): every rank
raises when one said its arguments were wrong (or when nobody needed more rounds: the device refused
an input), else the batch goes in ``ceil(max / C)`` rounds. A padded one (``num_worst_tokens`` W,
which every rank passes alike) meets nobody first: it runs ``ceil(ceil(W / R) / C)`` rounds, as many
as ``R`` ranks of ``W / R`` tokens each need (DeepEP's callers pass ``W = R x`` the most tokens per
rank), so in one round it returns at launch; a rank with more tokens than those rounds hold refuses
the call, and so do its peers, at once (``ep.Buffer.refuse_dispatch``). The outputs are fresh
tensors in DeepEP's order (source rank, then source token): round k's rows from source s land after
that source's rows of the earlier rounds. Each round's rows are copied out of the receive area on
the caller's stream before the next round starts, then placed; no peer writes that area again before
this rank's stream has passed the copy (a fresh round's count exchange, or a cached round's arrival
flags, Note [Arrival flags] in ep.wire.flags). The handle keeps every round's warmlink handle and
where its rows went: a cached dispatch replays the same rounds, and a combine sends each round's
rows back with its round's handle, each token summed in the one round that carried it. Memory stays
within the budget; each extra round costs a round's fixed host time and one more copy of its rows.
Every round's counts per rank and per expert are made before the first round, in one pass
(``_round_counts``), not by a layout per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from warmlink.ep.wire.handle import check_worst_tokens
from warmlink.ep.wire.words import RefusedRound
from warmlink.errors import ConfigError, PeerLostError, TransferTimeout

__all__ = ["Round", "after_refused_round", "argument_problem", "combine_rounds", "dispatch_cached_rounds",
           "dispatch_rounds", "padded_rounds"]


@dataclass
class Round:
    """One round of a batch sent in several: its warmlink handle, this rank's tokens
    ``[start, stop)``, and ``rows``: where each row it received lies in the call's outputs."""

    handle: object
    start: int
    stop: int
    rows: torch.Tensor


_REFUSED = 1 << 62  # a rank's meet value when its own arguments are wrong: every rank raises, none sends


def after_refused_round(inner, num_tokens: int, own: ConfigError | None = None,
                        refused: RefusedRound | None = None) -> int:
    """Rounds of a fresh dispatch whose first round was refused on every rank (Note [Rounds beyond
    the budget]): every rank's token count gathered, then ``ceil(max / C)``, more than one. ``own``:
    this rank's arguments were wrong (it says so in the meet, then raises ``own``); ``refused``: the
    peers' refusal this rank heard, raised again when no rank needs more rounds (the device refused
    an input). Every rank raises alike when one said its arguments were wrong. Collective."""
    try:
        counts = inner.all_gather_int(_REFUSED if own is not None else num_tokens)
    except (TransferTimeout, PeerLostError):
        if own is not None or refused is not None:  # the error the call made comes first
            raise (own if own is not None else refused) from None
        raise
    if own is not None:
        raise own
    wrong = [r for r, n in enumerate(counts) if n >= _REFUSED]
    if wrong:
        raise ConfigError(f"deep_ep.Buffer.dispatch: ranks {wrong} refused their arguments (each raised why); "
                          "nothing was sent")
    num_rounds = -(-max(counts) // inner.layout.max_tokens)
    if num_rounds <= 1 and refused is not None:
        raise refused
    return max(1, num_rounds)


def padded_rounds(inner, num_worst_tokens: int, num_tokens: int) -> tuple[int, str | None]:
    """Rounds of a padded fresh dispatch, taken from ``num_worst_tokens`` alone, which every rank
    passes alike: ``ceil(ceil(W / R) / C)``, so no rank meets its peers' hosts first (Note [Rounds
    beyond the budget]); and what is wrong when this rank's ``num_tokens`` do not fit them (or None)."""
    num_ranks, cap = inner.num_ranks, inner.layout.max_tokens
    if not isinstance(num_worst_tokens, int) or isinstance(num_worst_tokens, bool) or num_worst_tokens < 1:
        return 1, None  # ep refuses it, on every rank
    share = -(-num_worst_tokens // num_ranks)  # each rank's tokens, ceil(W / R)
    num_rounds = max(1, -(-share // cap))
    if num_tokens > num_rounds * cap:
        return num_rounds, (
            f"deep_ep.Buffer.dispatch: x has {num_tokens} tokens, but num_worst_tokens={num_worst_tokens} at "
            f"{num_ranks} ranks sends {num_rounds} round(s) of at most {cap} tokens per rank ({num_rounds * cap} in "
            "all): a padded dispatch takes its rounds from num_worst_tokens, every rank alike, without meeting its "
            "peers; pass num_worst_tokens >= num_ranks * the most tokens any rank sends (as DeepEP's tests do)")
    return num_rounds, None


def argument_problem(num_tokens: int, num_ranks: int, in_rank, topk_idx, topk_weights, per_expert) -> str | None:
    """What is wrong with a fresh dispatch's routing shapes, which the rounds would slice (ep checks
    each round's values, and its own refusals reach every rank), or None."""
    shapes = {"is_token_in_rank": (in_rank, (num_tokens, num_ranks)),
              "topk_idx": (topk_idx, (num_tokens, getattr(topk_idx, "shape", (0, 0))[-1])),
              "topk_weights": (topk_weights, (num_tokens, getattr(topk_idx, "shape", (0, 0))[-1]))}
    for name, (t, shape) in shapes.items():
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            return (f"deep_ep.Buffer.dispatch: {name} has shape {tuple(getattr(t, 'shape', ()))}; expected {shape} "
                    f"(x has {num_tokens} tokens; pass get_dispatch_layout's outputs for this topk_idx)")
    if not isinstance(per_expert, torch.Tensor) or per_expert.dim() != 1:
        return (f"deep_ep.Buffer.dispatch: num_tokens_per_expert has shape {tuple(getattr(per_expert, 'shape', ()))}; "
                "expected [num_experts]")
    return None


def _rows_of(tokens, lo: int, hi: int):
    return tuple(t[lo:hi] for t in tokens) if isinstance(tokens, tuple) else tokens[lo:hi]


def dispatch_rounds(inner, tokens, num_rounds: int, in_rank: torch.Tensor, topk_idx: torch.Tensor,
                    topk_weights, per_expert: torch.Tensor, num_experts: int, with_topk: bool, expert_alignment: int,
                    num_worst_tokens: int):
    """A fresh dispatch of ``tokens`` in ``num_rounds`` rounds (Note [Rounds beyond the budget]).

    ``topk_idx`` is the call's (the all -1 column of a dispatch without top-k, whose per-expert
    counts ``per_expert`` then travel with the first round). Returns ``(recv_x, recv_idx, recv_w,
    num_recv_tokens_per_expert_list, rounds, count_matrix)``, the outputs fresh and in DeepEP's
    order. Collective.

    Raises:
        ConfigError: a rank would receive more rows than ``num_worst_tokens`` (every rank alike,
            after the rounds: each holds the same counts).
    """
    cap, num_tokens = inner.layout.max_tokens, in_rank.shape[0]
    round_per_rank, round_per_expert = _round_counts(in_rank, topk_idx if with_topk else None, num_experts, cap,
                                                     num_rounds)
    got, bounds = [], []
    for k in range(num_rounds):
        lo, hi = min(k * cap, num_tokens), min((k + 1) * cap, num_tokens)
        if with_topk:
            counts = round_per_expert[k]
        else:
            counts = per_expert if k == 0 else torch.zeros_like(per_expert)
        recv_x, recv_idx, recv_w, _, handle, _ = inner.dispatch(
            _rows_of(tokens, lo, hi), num_tokens_per_rank=round_per_rank[k],
            is_token_in_rank=in_rank[lo:hi], num_tokens_per_expert=counts, topk_idx=topk_idx[lo:hi],
            topk_weights=None if topk_weights is None else topk_weights[lo:hi])
        # the receive area is reused two rounds on: this round's rows leave it now
        values = tuple(t.clone() for t in recv_x) if isinstance(recv_x, tuple) else recv_x.clone()
        got.append((values, recv_idx, recv_w, handle))
        bounds.append((lo, hi))
    handles = [g[3] for g in got]
    matrix = _summed([h.count_matrix for h in handles])
    # every rank holds the summed matrix, so all refuse alike
    total = check_worst_tokens(matrix, num_worst_tokens, "deep_ep.Buffer.dispatch (in rounds)")[inner.rank]
    places = _places([h.recv_counts for h in handles], _flat(got[0][0])[0].device)
    rows_out = num_worst_tokens or total
    first = got[0]
    out_x = _like(first[0], rows_out)
    out_idx, out_w = _like(first[1], rows_out, fill=-1), _like(first[2], rows_out, fill=0)
    for (values, recv_idx, recv_w, _), rows in zip(got, places):
        for out, part in (*zip(_flat(out_x), _flat(values)), (out_idx, recv_idx), (out_w, recv_w)):
            if out is not None:
                _place(out, rows, part)
    per_expert_sums = [sum(col) for col in zip(*(h.num_recv_tokens_per_expert_list for h in handles))]
    per_expert_list = [] if num_worst_tokens else [-(-n // expert_alignment) * expert_alignment for n in per_expert_sums]
    rounds = [Round(h, lo, hi, rows) for h, (lo, hi), rows in zip(handles, bounds, places)]
    return out_x, out_idx, out_w, per_expert_list, rounds, matrix


def dispatch_cached_rounds(inner, tokens, rounds: list[Round], num_recv: int):
    """A cached dispatch of ``tokens`` through ``rounds`` (a fresh dispatch's): fresh outputs
    with ``num_recv`` rows (its padded count), each round's rows copied out before the next
    round starts. Collective."""
    out = None
    for r in rounds:
        recv_x = inner.dispatch(_rows_of(tokens, r.start, r.stop), handle=r.handle)[0]
        if out is None:
            out = _like(recv_x, num_recv)
        for dst, part in zip(_flat(out), _flat(recv_x)):
            _place(dst, r.rows, part)
    return out


def combine_rounds(inner, x: torch.Tensor, topk_weights, rounds: list[Round], num_tokens: int):
    """``(combined_x [num_tokens, hidden], combined_weights or None)`` of ``x`` (rows in the
    dispatch's output order) through ``rounds``: each round sends back the rows it carried, and
    this rank's tokens of that round get their sums. Collective."""
    out = x.new_empty(num_tokens, x.shape[1])
    out_w = None if topk_weights is None else topk_weights.new_empty(num_tokens, topk_weights.shape[1])
    for r in rounds:
        w = None if topk_weights is None else topk_weights.index_select(0, r.rows)
        summed, summed_w, _ = inner.combine(x.index_select(0, r.rows), r.handle, topk_weights=w)
        out[r.start:r.stop] = summed
        if out_w is not None:
            out_w[r.start:r.stop] = summed_w
    return out, out_w


def _round_counts(in_rank: torch.Tensor, topk_idx: torch.Tensor | None, num_experts: int, cap: int, num_rounds: int):
    """``(per_rank [rounds, R], per_expert [rounds, E])`` int32: each round's token count per
    destination rank and its (token, expert) count per expert (ids outside ``[0, E)`` not
    counted, as ``get_dispatch_layout``'s), all rounds in one pass on the device: a layout per
    round cost ~0.3 ms of host each (15 rounds: ~4.5 ms of a 12 ms dispatch on an H100).
    ``per_expert`` is None without ``topk_idx``."""
    dev = in_rank.device
    round_of = torch.arange(in_rank.shape[0], device=dev) // cap
    per_rank = torch.zeros(num_rounds, in_rank.shape[1], dtype=torch.int32, device=dev)
    per_rank.index_add_(0, round_of, in_rank.to(torch.int32))
    if topk_idx is None:
        return per_rank, None
    idx = topk_idx.long()
    column = torch.where((idx >= 0) & (idx < num_experts), idx, num_experts)  # a dump column, sliced off
    slots = (round_of[:, None] * (num_experts + 1) + column).reshape(-1)
    per_expert = torch.zeros(num_rounds * (num_experts + 1), dtype=torch.int32, device=dev)
    per_expert.scatter_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
    return per_rank, per_expert.view(num_rounds, num_experts + 1)[:, :num_experts]


def _summed(matrices: list[list[list[int]]]) -> list[list[int]]:
    return [[sum(m[s][d] for m in matrices) for d in range(len(matrices[0]))] for s in range(len(matrices[0]))]


def _places(per_round: list[list[int]], device) -> list[torch.Tensor]:
    """Per round, the output row of each row it received (received by source rank, then token):
    source s's rows of round k follow its rows of rounds before k, after every earlier source's."""
    num_ranks = len(per_round[0])
    per_source = [sum(counts[s] for counts in per_round) for s in range(num_ranks)]
    start = [sum(per_source[:s]) for s in range(num_ranks)]
    places = []
    for counts in per_round:
        parts = [torch.arange(start[s], start[s] + counts[s], dtype=torch.int64, device="cpu") for s in range(num_ranks)]
        places.append(torch.cat(parts).to(device))
        start = [start[s] + counts[s] for s in range(num_ranks)]
    return places


def _like(t, rows: int, fill=None):
    """A fresh tensor (or pair) shaped like ``t`` with ``rows`` rows: zeros, or ``fill``; None for None."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_like(part, rows) for part in t)
    out = t.new_zeros((rows, *t.shape[1:]))
    return out.fill_(fill) if fill else out


def _place(out: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> None:
    """``out[rows] = part``; FP8 moves as bytes (torch has no index copy for float8 types)."""
    if out.element_size() == 1:
        out, part = out.view(torch.uint8), part.view(torch.uint8)
    out.index_copy_(0, rows, part)


def _flat(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)
