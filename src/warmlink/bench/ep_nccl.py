"""The MoE expert-parallel baseline that ``warmlink bench ep`` prints beside warmlink: torch + NCCL.

This is dispatch/combine the way MoE code does it today without DeepEP: compute the layout in
torch, exchange counts with ``all_to_all_single``, gather the tokens in destination order with
``index_select``, move them (and their top-k ids and weights) with ``all_to_all_single`` and split
sizes; combine is the reverse ``all_to_all_single`` and an ``index_add_`` in float32. The outputs
follow DeepEP's normal mode exactly (see ``nccl_dispatch``), so the bench can check warmlink's
results against these, and ``tests/ep/test_ep_nccl.py`` checks these against a Python oracle.

Every function here is per rank and collective over an already-initialized process group (NCCL
on GPU, gloo on CPU); the caller creates it with ``init_process_group(timeout=...)``, which is what
bounds every wait inside. gloo in torch 2.13 supports ``all_to_all_single`` with uneven splits
(checked for bf16, uint8, int64, float32), but not float8 tensors ("Invalid scalar type"), so
FP8 payloads always travel as a ``uint8`` view; a view costs nothing, and it also spares NCCL
builds without FP8 support.

# Note [EP baseline bytes and time]
Bytes: ``a2a_bytes`` is what this rank *sends to other ranks* of x in dispatch, i.e.
``sum over d != rank of num_tokens_per_rank[d] * row_bytes``, with ``row_bytes = H * 2`` for bf16
and ``H + ceil(H / 128) * 4`` for the FP8 tuple (values and float32 scales). Rows a rank keeps for
itself and the metadata (counts, top-k ids, weights) are not counted: they are not "the bytes that
cross". ``combine_bytes`` is likewise what this rank sends back to other ranks in combine
(``sum over s != rank of recv rows from s * H * 2``; combine always moves bf16, as DeepEP's does).
At the issue-4 shapes (4 ranks, 4096 tokens, H = 7168, top-8 of 256 random experts) that is about
159 MB per rank in each direction.
Time: every timed iteration starts after an untimed alignment (a one-element ``all_reduce`` and,
on GPU, ``torch.cuda.synchronize``), so that no rank's clock includes waiting for a late peer's
previous iteration; the clock is the host's ``time.perf_counter`` around the operation, stopped
after ``torch.cuda.synchronize()`` on GPU (the torch path syncs the host anyway to read the
counts). There is no barrier inside the timed region. ``dispatch_s`` covers layout + count
exchange + permutation + the token, id and weight transfers, ending with the outputs ready;
``combine_s`` covers the reverse transfer and the float32 ``index_add_`` and cast (no weights);
``a2a_s`` is one bare ``all_to_all_single`` of exactly ``a2a_bytes`` (one uint8 buffer, buffers
allocated once outside the loop). Each is the median over ``iterations`` after ``warmup``
untimed runs, per rank; the bench reports each rank's own number (or their maximum).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warmlink.errors import ConfigError, LayoutError

__all__ = ["NcclDispatchResult", "NcclEpHandle", "nccl_combine", "nccl_dispatch", "nccl_layout", "time_nccl_ep"]

_FP8_BLOCK = 128  # columns per FP8 scale


class NcclEpHandle:
    """What combine needs from a dispatch: the send permutation and both split lists.

    Attributes:
        perm: ``[sum(send_splits)]`` int64 on x's device, the source token of each sent row, in
            send order (destination rank ascending, then token ascending).
        send_splits: rows sent to each rank in dispatch (list of R ints, own rank included).
        recv_splits: rows received from each rank in dispatch (list of R ints).
        num_tokens: tokens of this rank (rows of x).
    """

    __slots__ = ("num_tokens", "perm", "recv_splits", "send_splits")

    def __init__(self, perm, send_splits: list[int], recv_splits: list[int], num_tokens: int) -> None:
        self.perm, self.send_splits, self.recv_splits, self.num_tokens = perm, send_splits, recv_splits, num_tokens

    def __repr__(self) -> str:
        return f"NcclEpHandle(num_tokens={self.num_tokens}, send_splits={self.send_splits}, recv_splits={self.recv_splits})"


@dataclass(slots=True)
class NcclDispatchResult:
    """Dispatch outputs, shaped as DeepEP's normal-mode ``dispatch`` returns them.

    Attributes:
        recv_x: ``[N, H]`` in x's dtype, or the tuple ``(x_fp8 [N, H], scales float32 [N, ceil(H / 128)])``.
        recv_topk_idx: ``[N, K]`` int64, local expert ids (0 <= id < E // R) or -1.
        recv_topk_weights: ``[N, K]`` in the weights' dtype, 0 where the id is -1; None without weights.
        num_recv_tokens_per_expert_list: rows received per local expert (list of E // R ints).
        handle: for ``nccl_combine``.
    """

    recv_x: Any
    recv_topk_idx: Any
    recv_topk_weights: Any
    num_recv_tokens_per_expert_list: list[int]
    handle: NcclEpHandle


def nccl_layout(topk_idx, num_experts: int, num_ranks: int):
    """The dispatch layout of one rank's routing, vectorized in torch (no communication).

    Args:
        topk_idx: ``[T, K]`` int64 expert ids in ``[-1, num_experts)``, -1 = masked slot; no
            expert twice in a row (not checked: it would cost a sort).
        num_experts: E, a multiple of ``num_ranks``.
        num_ranks: R.

    Returns:
        ``(num_tokens_per_rank [R] int64, num_tokens_per_expert [E] int64, is_token_in_rank
        [T, R] bool)``, new tensors on topk_idx's device.

    Raises:
        ConfigError: E or R not positive, or E % R != 0.
        LayoutError: topk_idx not 2-d int64, or an id out of range (one host sync to check).
    """
    import torch

    if num_ranks <= 0 or num_experts <= 0 or num_experts % num_ranks:
        raise ConfigError(
            f"nccl_layout: num_experts={num_experts} invalid for num_ranks={num_ranks}; "
            "expected positive counts with num_experts % num_ranks == 0"
        )
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise LayoutError(
            f"nccl_layout: topk_idx shape={tuple(topk_idx.shape)} dtype={topk_idx.dtype} invalid; "
            "expected [num_tokens, num_topk] int64"
        )
    if topk_idx.numel() and bool(((topk_idx < -1) | (topk_idx >= num_experts)).any()):
        raise LayoutError(
            f"nccl_layout: topk_idx has ids in [{int(topk_idx.min())}, {int(topk_idx.max())}]; "
            f"expected -1 <= id < num_experts={num_experts}"
        )
    valid = topk_idx >= 0
    # Masked slots go to an extra column R, dropped after the scatter, so no branch is needed.
    dest = torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    is_token_in_rank = in_rank.scatter_(1, dest, True)[:, :num_ranks]
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int64)
    num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def _split_x(x, num_tokens: int, where: str):
    """``(values, scales or None)`` of x, validated against the routing's token count."""
    import torch

    values, scales = x if isinstance(x, tuple) else (x, None)
    if values.dim() != 2 or values.shape[0] != num_tokens:
        raise LayoutError(f"{where}: x shape={tuple(values.shape)} invalid; expected [num_tokens={num_tokens}, hidden]")
    if scales is not None:
        hidden, blocks = values.shape[1], -(-values.shape[1] // _FP8_BLOCK)  # a last block may be partial
        if values.dtype != torch.float8_e4m3fn:
            raise LayoutError(f"{where}: FP8 x dtype={values.dtype} invalid; expected float8_e4m3fn")
        if tuple(scales.shape) != (num_tokens, blocks) or scales.dtype != torch.float32:
            raise LayoutError(
                f"{where}: FP8 scales shape={tuple(scales.shape)} dtype={scales.dtype} invalid; "
                f"expected [{num_tokens}, ceil({hidden} / {_FP8_BLOCK}) = {blocks}] float32"
            )
    return values, scales


def _a2a(out, inp, out_splits: list[int], in_splits: list[int], group) -> None:
    """``all_to_all_single`` along dim 0; float8 moves as uint8 (gloo has no float8, see module doc)."""
    import torch
    import torch.distributed as dist

    if inp.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)


def nccl_dispatch(x, topk_idx, topk_weights, num_experts: int, group=None) -> NcclDispatchResult:
    """Send each token once to every rank that holds one of its experts (DeepEP normal mode).

    Args:
        x: ``[T, H]`` (bf16 or any dtype the backend moves), or the FP8 tuple ``(x_fp8
            float8_e4m3fn [T, H], scales float32 [T, ceil(H / 128)])``; T may be 0.
        topk_idx: ``[T, K]`` int64 expert ids in ``[-1, E)``, -1 = masked; expert e lives on rank
            ``e // (E // R)``.
        topk_weights: ``[T, K]`` float32, or None.
        num_experts: E, a multiple of the group size R.
        group: the process group (None = default); its timeout bounds every wait.

    Returns:
        ``NcclDispatchResult``: rows ordered by source rank, then source token; new tensors on x's
        device, owned by the caller, ready on the current stream when this returns.

    Raises:
        ConfigError, LayoutError: bad arguments, raised before any communication on this rank
            (peers that did call in then fail at the group's timeout).

    Collective: every rank of ``group``. Blocking: yes, the host reads the exchanged counts.
    Warm path: no; it allocates every output and every send buffer, as the torch path does.
    """
    import torch
    import torch.distributed as dist

    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    # Validation first (layout is local): a bad rank must fail before it enters any collective.
    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = nccl_layout(topk_idx, num_experts, num_ranks)
    values, scales = _split_x(x, topk_idx.shape[0], "nccl_dispatch")
    if topk_weights is not None and tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise LayoutError(
            f"nccl_dispatch: rank={rank} topk_weights shape={tuple(topk_weights.shape)} does not match "
            f"topk_idx shape={tuple(topk_idx.shape)}"
        )
    experts_per_rank = num_experts // num_ranks

    # Count exchange, one collective: per destination, [its token count, counts of its experts].
    send_counts = torch.cat([num_tokens_per_rank[:, None], num_tokens_per_expert.view(num_ranks, experts_per_rank)], 1)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = torch.stack([send_counts, recv_counts]).cpu()  # one host sync for both: splits must be ints
    send_splits, recv_splits = counts[0, :, 0].tolist(), counts[1, :, 0].tolist()
    num_recv_tokens_per_expert_list = counts[1, :, 1:].sum(0).tolist()

    # Permutation: nonzero of the [R, T] mask is row-major, i.e. destination then token ascending,
    # which is exactly the order each receiver must see within one source's block.
    dest, perm = is_token_in_rank.t().nonzero(as_tuple=True)
    send_idx = topk_idx.index_select(0, perm)
    local_idx = send_idx - dest[:, None] * experts_per_rank
    # The sender translates ids, so the receiver's rows are final the moment they land.
    keep = (send_idx >= 0) & (local_idx >= 0) & (local_idx < experts_per_rank)
    num_recv = sum(recv_splits)

    def move(src):
        out = src.new_empty((num_recv, *src.shape[1:]))
        _a2a(out, src, recv_splits, send_splits, group)
        return out

    recv_values = move(values.index_select(0, perm))
    recv_x = recv_values if scales is None else (recv_values, move(scales.index_select(0, perm)))
    recv_topk_idx = move(torch.where(keep, local_idx, -1))
    recv_topk_weights = None
    if topk_weights is not None:
        recv_topk_weights = move(torch.where(keep, topk_weights.index_select(0, perm), 0))
    handle = NcclEpHandle(perm, send_splits, recv_splits, topk_idx.shape[0])
    return NcclDispatchResult(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)


def nccl_combine(y, handle: NcclEpHandle, topk_weights=None, group=None):
    """Send each received row back to its source and sum the copies of every token.

    Args:
        y: ``[N, H]``, row i aligned with row i of this rank's dispatch output (N =
            ``sum(handle.recv_splits)``), typically bf16.
        handle: from ``nccl_dispatch`` of the same step on this rank.
        topk_weights: ``[N, K]`` float32 to sum likewise, or None.
        group: the process group the dispatch used.

    Returns:
        ``(combined_x [T, H] in y's dtype, combined_weights [T, K] float32 or None)``: float32
        sums over the ranks each token went to, cast to y's dtype; zeros for tokens that went to no
        rank. New tensors on y's device, ready on the current stream.

    Raises:
        LayoutError: y or topk_weights rows differ from the handle's received rows.

    Collective: every rank of ``group``. Blocking: no host sync of its own (gloo is synchronous).
    Warm path: no; allocates the return buffer and the outputs.
    """
    import torch

    num_recv, num_send = sum(handle.recv_splits), sum(handle.send_splits)
    for name, t in (("y", y), ("topk_weights", topk_weights)):
        if t is not None and (t.dim() != 2 or t.shape[0] != num_recv):
            raise LayoutError(f"nccl_combine: {name} shape={tuple(t.shape)} invalid; expected [{num_recv}, ...] per the handle")

    def back_and_sum(src):
        back = src.new_empty((num_send, src.shape[1]))
        _a2a(back, src, handle.send_splits, handle.recv_splits, group)
        out = torch.zeros(handle.num_tokens, src.shape[1], dtype=torch.float32, device=src.device)
        return out.index_add_(0, handle.perm, back.float())

    combined_x = back_and_sum(y).to(y.dtype)
    combined_weights = None if topk_weights is None else back_and_sum(topk_weights)
    return combined_x, combined_weights


def time_nccl_ep(x, topk_idx, topk_weights, num_experts: int, iterations: int, warmup: int, *, group=None) -> dict[str, Any]:
    """Median times of the torch + NCCL dispatch, combine and a bare all-to-all of the same bytes.

    See Note [EP baseline bytes and time] in the module docstring for exactly what is counted.

    Args:
        x, topk_idx, topk_weights, num_experts: as for ``nccl_dispatch``.
        iterations: timed runs of each operation, >= 1.
        warmup: untimed runs of each operation before them, >= 0.
        group: the process group (None = default).

    Returns:
        ``{"dispatch_s", "combine_s", "a2a_s"}`` (median seconds on this rank), ``"a2a_bytes"``
        (x bytes this rank sends to other ranks in dispatch, moved by the bare all-to-all),
        ``"combine_bytes"`` (bf16 bytes it sends to other ranks in combine), ``"iterations"``.

    Raises:
        ConfigError: iterations < 1 or warmup < 0. LayoutError: as ``nccl_dispatch``.

    Collective: every rank of ``group``, with the same iterations and warmup.
    """
    import torch
    import torch.distributed as dist

    if iterations < 1 or warmup < 0:
        raise ConfigError(f"time_nccl_ep: iterations={iterations} warmup={warmup} invalid; expected >= 1 and >= 0")
    rank = dist.get_rank(group)
    values, scales = x if isinstance(x, tuple) else (x, None)
    device = values.device
    cuda = device.type == "cuda"
    flag = torch.zeros(1, device=device)

    def timed(fn: Callable[[], object]) -> list[float]:
        samples = []
        for i in range(warmup + iterations):
            dist.all_reduce(flag, group=group)  # untimed alignment, see the module Note
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        return samples

    first = nccl_dispatch(x, topk_idx, topk_weights, num_experts, group=group)
    recv_values = first.recv_x if scales is None else first.recv_x[0]
    y = recv_values.to(torch.bfloat16)  # combine moves bf16, also after an FP8 dispatch
    h = first.handle

    row_bytes = values.shape[1] * values.element_size() + (0 if scales is None else scales.shape[1] * 4)
    send_other = [n if d != rank else 0 for d, n in enumerate(h.send_splits)]
    recv_other = [n if d != rank else 0 for d, n in enumerate(h.recv_splits)]
    send_buf = torch.zeros(sum(send_other), row_bytes, dtype=torch.uint8, device=device)
    recv_buf = torch.empty(sum(recv_other), row_bytes, dtype=torch.uint8, device=device)

    dispatch = timed(lambda: nccl_dispatch(x, topk_idx, topk_weights, num_experts, group=group))
    combine = timed(lambda: nccl_combine(y, h, group=group))
    a2a = timed(lambda: dist.all_to_all_single(recv_buf, send_buf, recv_other, send_other, group=group))
    return {
        "dispatch_s": statistics.median(dispatch),
        "combine_s": statistics.median(combine),
        "a2a_s": statistics.median(a2a),
        "a2a_bytes": sum(send_other) * row_bytes,
        "combine_bytes": sum(recv_other) * values.shape[1] * 2,
        "iterations": iterations,
    }
