"""How a DeepEP byte budget becomes the sizes of a warmlink ``ep.Buffer``.

DeepEP's normal mode streams tokens through rings, so one ``num_nvl_bytes`` fits any batch.
warmlink's Buffer holds fixed slots instead (ep.wire.regions): per rank and per parity a receive row
for every token any source may send, a combine row, and a staging row per destination, so its
bytes grow with ``max_tokens_per_rank x hidden x num_ranks``. ``deep_ep.Buffer`` therefore builds
the largest warmlink Buffer whose ``size_hint`` fits the budget, for the hidden size (rounded up
to a multiple of 8) and top-k of its widest dispatch, and sends a batch of more tokens than that
holds in several rounds
(deep_ep.rounds), never taking more memory than the budget.

On CUDA ``deep_ep.Buffer`` builds a streamed Buffer instead (``send="stream"``, ep.paths.streamed),
whose receive space is fixed whatever the batch (``stream_within``): one call at any batch, no
rounds; with the Triton streamed kernels only when a slot round of the budget would not hold the
first dispatch's batch (deep_ep.inner, Note [Built on first dispatch]).

The slots are sized from the budget alone, not from any rank's batch, so every rank of the group
computes the same sizes (a group's ranks must share them, ep.wire.info).

Low-latency mode is sized by its call's shapes, as DeepEP's is: ``low_latency_bytes`` is what the
warmlink Buffer built for them holds, its low-latency region and outputs
(``ep.Buffer.get_low_latency_rdma_size_hint``) plus the normal-mode slots every ``ep.Buffer``
holds for the same sizes (``ep.size_hint``), and ``num_rdma_bytes`` must hold that.
"""

from __future__ import annotations

from warmlink.ep import Buffer, size_hint
from warmlink.ep.api.options import stream_defaults
from warmlink.ep.wire.regions import RegionLayout
from warmlink.errors import ConfigError

__all__ = ["LL_MAX_TOPK", "MAX_TOKENS", "built_hidden", "low_latency_bytes", "needed_bytes", "refuse", "stream_within", "tokens_within"]

MAX_TOKENS = 1 << 24  # the most tokens per rank an ep group may be built for (ep.wire.info)
LL_MAX_TOPK = 9  # the widest top-k DeepEP V1's low-latency kernels take: what its size hint, naming none, holds


def built_hidden(hidden: int) -> int:
    """The hidden size of the warmlink Buffer that holds calls of ``hidden`` channels: rows move as
    8-byte words, so a narrower call is padded to a multiple of 8 (deep_ep.inner)."""
    return -(-hidden // 8) * 8 if isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0 else hidden


def needed_bytes(num_tokens: int, num_ranks: int, hidden: int, num_topk: int) -> int:
    """Bytes of one rank's warmlink Buffer for batches of up to ``num_tokens`` tokens per rank."""
    return size_hint(max(num_tokens, 1), built_hidden(hidden), num_ranks=num_ranks, num_topk=num_topk)


def tokens_within(budget_bytes: int, num_ranks: int, hidden: int, num_topk: int) -> int:
    """The most tokens per rank a warmlink Buffer of these sizes holds within ``budget_bytes``
    (0 when not even one token fits). Buffer bytes grow with the token count, so a bisection finds it.

    Raises:
        ConfigError: ``hidden`` or ``num_topk`` that a Buffer refuses.
    """
    if needed_bytes(1, num_ranks, hidden, num_topk) > budget_bytes:
        return 0
    lo, hi = 1, MAX_TOKENS  # needed_bytes(lo) fits; find the last that does
    if needed_bytes(hi, num_ranks, hidden, num_topk) <= budget_bytes:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if needed_bytes(mid, num_ranks, hidden, num_topk) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def stream_within(budget_bytes: int, num_ranks: int, hidden: int, num_topk: int,
                  max_channels: int) -> tuple[int, int] | None:
    """``(stream_channels, ring_rows)`` of the streamed Buffer that fits ``budget_bytes`` (ep.paths.streamed):
    the default channels (at most ``max_channels``) with the most ring rows up to the default, a power of 2
    (at least 8, a stream kernel's tile); half the channels when not even that fits; None when one
    channel of 8 rows does not fit."""
    default_channels, default_rows = stream_defaults(num_ranks)
    channels = min(default_channels, max_channels)
    while channels >= 1:
        ring_rows = default_rows
        while ring_rows >= 8:
            layout = RegionLayout(num_ranks, MAX_TOKENS, built_hidden(hidden), num_topk, channels, ring_rows)
            if layout.nbytes <= budget_bytes:
                return channels, ring_rows
            ring_rows //= 2
        channels //= 2
    return None


def refuse(func: str, budget_bytes: int, num_ranks: int, hidden: int, num_topk: int) -> ConfigError:
    """The error for a budget of ``budget_bytes`` that holds not one token per rank."""
    need = needed_bytes(1, num_ranks, hidden, num_topk)
    return ConfigError(
        f"{func}: num_nvl_bytes={budget_bytes} ({budget_bytes / 2**30:.3f} GiB) holds not one token per rank at "
        f"hidden={hidden}, num_topk={num_topk} and {num_ranks} ranks; one needs {need} bytes (warmlink.ep keeps a slot "
        f"per source rank, not DeepEP's rings): pass num_nvl_bytes >= {need}, e.g. from Config.get_nvl_buffer_size_hint")


def low_latency_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                      num_topk: int = LL_MAX_TOPK) -> int:
    """Bytes of one rank's warmlink Buffer in low-latency mode for these sizes: the low-latency
    region and outputs plus the normal-mode slots of the same Buffer.

    Raises:
        ConfigError: sizes the low-latency mode refuses (hidden not a multiple of 128, num_experts
            not a multiple of num_ranks, a size that is not a positive int).
    """
    tokens = num_max_dispatch_tokens_per_rank
    return (Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, num_experts, num_topk=num_topk)
            + size_hint(tokens, hidden, num_ranks=num_ranks, num_topk=num_topk))
