"""A single-process, global oracle of MoE expert-parallel dispatch/combine (DeepEP normal mode).

Written as plain loops over Python ints on purpose: it is what every faster implementation
(``warmlink.ep``, the torch + NCCL baseline in ``warmlink.bench.ep_nccl``) is checked against, so
it must be obviously right rather than fast. It sees every rank's inputs at once; a test that runs
R processes builds all R ranks' inputs from one seed in each process and compares its own slice.

# Note [EP semantics]
R ranks, E experts (E % R == 0), E_local = E // R; expert e lives on rank e // E_local. Rank s
holds x_s [T_s, H] (or an FP8 tuple (x_fp8 [T_s, H], scales float32 [T_s, H // 128])),
topk_idx_s [T_s, K] int64 in [-1, E) (-1 = masked slot, no expert twice in a row) and
topk_weights_s [T_s, K] float32. Row t of rank s goes once to every rank d that holds any of its
experts. Receiver d orders its rows by source rank, then source token index; a row's top-k ids
become local expert ids (e - d * E_local) where the expert lives on d and -1 elsewhere, its
weights are kept where the id is kept and 0 elsewhere. Combine sums, per source token, the rows
that the receivers send back (float32 accumulation, cast to y's dtype; a token that went nowhere
gets zeros), and likewise their top-k weights.

# Note [Token pattern]
``token_pattern`` writes (rank, token) into the first six columns as base-16 digits (0..15) and
fills the rest with integers in [-8, 8]. All of these are exact in bf16, fp16, fp32 and
float8_e4m3fn, and so are their sums over a few ranks in bf16 (integers up to 256 are exact), so
combine results can be compared with ``torch.equal``. For FP8 the scales (one per 128 columns)
are all ``rank * 65536 + token + 1``, exact in float32 for rank < 256 and token < 65536.
"""

from __future__ import annotations

import torch

__all__ = [
    "decode_token_pattern",
    "random_routing",
    "reference_combine",
    "reference_dispatch",
    "reference_layout",
    "token_pattern",
]

_DIGITS = 6  # 2 base-16 digits of rank, 4 of token
_MAX_RANK = 16**2
_MAX_TOKEN = 16**4
_FP8_BLOCK = 128  # columns per FP8 scale


def _check_topk(topk_idx: torch.Tensor, num_experts: int, where: str) -> None:
    if topk_idx.dim() != 2:
        raise ValueError(f"{where}: topk_idx.shape={tuple(topk_idx.shape)} is not 2-d; expected [num_tokens, num_topk]")
    for t, row in enumerate(topk_idx.tolist()):
        experts = [e for e in row if e != -1]
        if any(e < -1 or e >= num_experts for e in row):
            raise ValueError(f"{where}: topk_idx[{t}]={row} out of range; expected -1 <= e < num_experts={num_experts}")
        if len(set(experts)) != len(experts):
            raise ValueError(f"{where}: topk_idx[{t}]={row} repeats an expert; expected distinct experts per row")


def _experts_per_rank(num_experts: int, num_ranks: int) -> int:
    if num_ranks <= 0 or num_experts <= 0 or num_experts % num_ranks != 0:
        raise ValueError(
            f"reference: num_experts={num_experts} with num_ranks={num_ranks} invalid; "
            "expected positive counts and num_experts % num_ranks == 0"
        )
    return num_experts // num_ranks


def reference_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layout of one rank's routing, with loops.

    Args:
        topk_idx: ``[num_tokens, num_topk]`` int64, expert ids in ``[-1, num_experts)``, -1 = masked.
        num_experts: E, a multiple of ``num_ranks``.
        num_ranks: R.

    Returns:
        ``(num_tokens_per_rank [R] int64, num_tokens_per_expert [E] int64, is_token_in_rank
        [num_tokens, R] bool)``, new CPU tensors.

    Raises:
        ValueError: bad shapes, ids out of range, a repeated expert in a row, E % R != 0.
    """
    experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    _check_topk(topk_idx, num_experts, "reference_layout")
    rows = topk_idx.tolist()
    is_token_in_rank = torch.zeros(len(rows), num_ranks, dtype=torch.bool)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)
    for t, row in enumerate(rows):
        for e in row:
            if e == -1:
                continue
            is_token_in_rank[t, e // experts_per_rank] = True
            num_tokens_per_expert[e] += 1
    num_tokens_per_rank = torch.zeros(num_ranks, dtype=torch.int64)
    for t in range(len(rows)):
        for d in range(num_ranks):
            if is_token_in_rank[t, d]:
                num_tokens_per_rank[d] += 1
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def _rows(x, index: list[int]):
    """Rows ``index`` of a tensor or of each tensor of an FP8 tuple."""
    idx = torch.tensor(index, dtype=torch.int64)
    if isinstance(x, tuple):
        return tuple(part.cpu()[idx] for part in x)
    return x.cpu()[idx]


def _cat(parts: list):
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts)


def reference_dispatch(xs: list, topk_idxs: list, topk_weights_list: list | None, num_experts: int) -> list[dict]:
    """Dispatch of every rank's tokens to every receiver. See Note [EP semantics].

    Args:
        xs: per source rank, ``[T_s, H]`` tensor, or an FP8 tuple ``(x_fp8 [T_s, H], scales
            float32 [T_s, H // 128])``. ``T_s`` may be 0.
        topk_idxs: per source rank, ``[T_s, K]`` int64 in ``[-1, E)``.
        topk_weights_list: per source rank, ``[T_s, K]`` float32; or None for no weights.
        num_experts: E, a multiple of ``len(xs)``.

    Returns:
        One dict per receiver rank d, with CPU tensors: ``recv_x`` (``[N_d, H]`` or the FP8 tuple),
        ``recv_topk_idx`` ``[N_d, K]`` int64 local expert ids or -1, ``recv_topk_weights``
        ``[N_d, K]`` (None without weights), ``num_recv_tokens_per_expert_list`` (list of
        ``E // R`` ints) and ``recv_src``: the ``(source rank, source token)`` of each row.

    Raises:
        ValueError: mismatched lengths or shapes, bad ids (see ``reference_layout``).
    """
    num_ranks = len(xs)
    experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    if len(topk_idxs) != num_ranks or (topk_weights_list is not None and len(topk_weights_list) != num_ranks):
        raise ValueError(f"reference_dispatch: got {num_ranks} xs but {len(topk_idxs)} topk_idxs; expected one per rank")
    layouts = [reference_layout(topk_idxs[s], num_experts, num_ranks) for s in range(num_ranks)]
    for s in range(num_ranks):
        rows_x = (xs[s][0] if isinstance(xs[s], tuple) else xs[s]).shape[0]
        if rows_x != topk_idxs[s].shape[0]:
            raise ValueError(f"reference_dispatch: rank {s} has {rows_x} rows of x but {topk_idxs[s].shape[0]} of topk_idx")

    results = []
    for d in range(num_ranks):
        parts, recv_src, recv_idx, recv_w = [], [], [], []
        for s in range(num_ranks):
            in_rank = layouts[s][2]
            tokens = [t for t in range(topk_idxs[s].shape[0]) if bool(in_rank[t, d])]
            parts.append(_rows(xs[s], tokens))
            for t in tokens:
                recv_src.append((s, t))
                idx_row, w_row = [], []
                for k, e in enumerate(topk_idxs[s][t].tolist()):
                    if e != -1 and e // experts_per_rank == d:
                        idx_row.append(e - d * experts_per_rank)
                        w_row.append(float(topk_weights_list[s][t, k]) if topk_weights_list is not None else 0.0)
                    else:
                        idx_row.append(-1)
                        w_row.append(0.0)
                recv_idx.append(idx_row)
                recv_w.append(w_row)
        num_topk = topk_idxs[0].shape[1]
        counts = [sum(int(layouts[s][1][d * experts_per_rank + j]) for s in range(num_ranks)) for j in range(experts_per_rank)]
        weights = None
        if topk_weights_list is not None:
            weights = torch.tensor(recv_w, dtype=topk_weights_list[0].dtype).reshape(-1, num_topk)
        results.append({
            "recv_x": _cat(parts),
            "recv_topk_idx": torch.tensor(recv_idx, dtype=torch.int64).reshape(-1, num_topk),
            "recv_topk_weights": weights,
            "num_recv_tokens_per_expert_list": counts,
            "recv_src": recv_src,
        })
    return results


def reference_combine(ys: list, recv_srcs: list, num_tokens: list[int], ws: list | None = None) -> list[dict]:
    """Combine: every receiver's rows summed back onto their source tokens. See Note [EP semantics].

    Args:
        ys: per receiver rank d, ``[N_d, H]``, row i aligned with that receiver's dispatch output.
        recv_srcs: per receiver, the ``(source rank, source token)`` of each row (``recv_src`` of
            ``reference_dispatch``).
        num_tokens: per source rank, its number of tokens ``T_s``.
        ws: per receiver, ``[N_d, K]`` weights to sum likewise; or None.

    Returns:
        One dict per source rank s with CPU tensors: ``out`` ``[T_s, H]`` in ys' dtype (float32
        sums, then cast; zeros for tokens sent nowhere) and ``combined_weights`` ``[T_s, K]``
        float32 (None without ws).

    Raises:
        ValueError: ys, recv_srcs (and ws) disagree in length or rows.
    """
    num_ranks = len(ys)
    if len(recv_srcs) != num_ranks or len(num_tokens) != num_ranks or (ws is not None and len(ws) != num_ranks):
        raise ValueError("reference_combine: ys, recv_srcs, num_tokens (and ws) need one entry per rank")
    hidden, dtype = ys[0].shape[1], ys[0].dtype
    outs = [torch.zeros(num_tokens[s], hidden, dtype=torch.float32) for s in range(num_ranks)]
    wsum = None
    if ws is not None:
        num_topk = ws[0].shape[1]
        wsum = [torch.zeros(num_tokens[s], num_topk, dtype=torch.float32) for s in range(num_ranks)]
    for d in range(num_ranks):
        if ys[d].shape[0] != len(recv_srcs[d]):
            raise ValueError(f"reference_combine: ys[{d}] has {ys[d].shape[0]} rows but recv_srcs[{d}] has {len(recv_srcs[d])}")
        for i, (s, t) in enumerate(recv_srcs[d]):
            outs[s][t] += ys[d][i].cpu().float()
            if wsum is not None:
                wsum[s][t] += ws[d][i].cpu().float()
    return [
        {"out": outs[s].to(dtype), "combined_weights": None if wsum is None else wsum[s]} for s in range(num_ranks)
    ]


def random_routing(
    num_tokens: int, num_experts: int, num_topk: int, generator: torch.Generator, mask_prob: float = 0.0
) -> torch.Tensor:
    """Random top-k routing: distinct experts per row (top-k of random scores), some slots masked.

    Args:
        num_tokens: rows T (may be 0).
        num_experts: E.
        num_topk: K <= E.
        generator: a CPU ``torch.Generator``; the result depends only on its state.
        mask_prob: probability that each slot is set to -1 independently.

    Returns:
        ``[T, K]`` int64 CPU tensor.

    Raises:
        ValueError: K > E or mask_prob outside [0, 1].
    """
    if not 0 < num_topk <= num_experts or not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"random_routing: num_topk={num_topk}, num_experts={num_experts}, mask_prob={mask_prob} invalid")
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_idx = scores.topk(num_topk, dim=1).indices.to(torch.int64)
    masked = torch.rand(num_tokens, num_topk, generator=generator) < mask_prob
    return topk_idx.masked_fill(masked, -1)


def _pattern_rows(ranks: torch.Tensor, tokens: torch.Tensor, hidden: int) -> torch.Tensor:
    """float32 ``[N, hidden]`` rows for (rank, token) pairs. See Note [Token pattern]."""
    cols = torch.arange(hidden, dtype=torch.int64)
    fill = (ranks[:, None] * 7 + tokens[:, None] * 3 + cols[None, :] * 5) % 17 - 8
    digits = [ranks // 16, ranks % 16, tokens // 4096, tokens // 256 % 16, tokens // 16 % 16, tokens % 16]
    fill[:, :_DIGITS] = torch.stack(digits, dim=1)
    return fill.to(torch.float32)


def token_pattern(rank: int, num_tokens: int, hidden: int, dtype: torch.dtype):
    """x for rank ``rank`` whose every row encodes (rank, token) exactly. See Note [Token pattern].

    Args:
        rank: source rank, 0 <= rank < 256.
        num_tokens: rows, < 65536 (may be 0).
        hidden: columns, >= 6; a multiple of 128 for ``torch.float8_e4m3fn``.
        dtype: bf16, fp16, fp32, or ``torch.float8_e4m3fn`` for an FP8 tuple.

    Returns:
        ``[num_tokens, hidden]`` CPU tensor, or for FP8 the tuple ``(x_fp8, scales float32
        [num_tokens, hidden // 128])``.

    Raises:
        ValueError: rank, num_tokens or hidden out of range.
    """
    fp8 = dtype == torch.float8_e4m3fn
    if not (0 <= rank < _MAX_RANK and 0 <= num_tokens < _MAX_TOKEN and hidden >= _DIGITS) or (fp8 and hidden % _FP8_BLOCK):
        raise ValueError(f"token_pattern: rank={rank}, num_tokens={num_tokens}, hidden={hidden} out of range for {dtype}")
    tokens = torch.arange(num_tokens, dtype=torch.int64)
    x = _pattern_rows(torch.full_like(tokens, rank), tokens, hidden).to(dtype)
    if not fp8:
        return x
    scales = (rank * _MAX_TOKEN + tokens + 1).to(torch.float32)[:, None].expand(-1, hidden // _FP8_BLOCK)
    return x, scales.contiguous()


def decode_token_pattern(x) -> tuple[torch.Tensor, torch.Tensor]:
    """The (source rank, source token) of each row of a ``token_pattern`` tensor (or FP8 tuple).

    Args:
        x: ``[N, H]`` rows taken from ``token_pattern`` outputs, or an FP8 tuple of them.

    Returns:
        ``(ranks [N] int64, tokens [N] int64)``.

    Raises:
        ValueError: a row (or its scales) is not exactly what ``token_pattern`` writes for the
            (rank, token) its first columns name: corruption, a torn row or a mixed-up scale.
    """
    scales = None
    if isinstance(x, tuple):
        x, scales = x
    values = x.cpu().to(torch.float32)
    ranks = (values[:, 0] * 16 + values[:, 1]).to(torch.int64)
    tokens = (((values[:, 2] * 16 + values[:, 3]) * 16 + values[:, 4]) * 16 + values[:, 5]).to(torch.int64)
    expected = _pattern_rows(ranks, tokens, x.shape[1]).to(x.dtype).to(torch.float32)
    bad = (values != expected).any(dim=1)
    if scales is not None:
        want = (ranks * _MAX_TOKEN + tokens + 1).to(torch.float32)[:, None]
        bad |= (scales.cpu() != want).any(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"decode_token_pattern: row {row} (of {x.shape[0]}) does not match the pattern of "
            f"rank={int(ranks[row])}, token={int(tokens[row])}; {int(bad.sum())} bad rows in all"
        )
    return ranks, tokens
