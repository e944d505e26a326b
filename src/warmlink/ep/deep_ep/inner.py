"""The warmlink ``ep.Buffer`` inside a ``deep_ep.Buffer``: built by the first dispatch, grown by a
wider one, and calls narrower than it padded to its width.

# Note [Built on first dispatch]
DeepEP's constructor takes a byte budget, not shapes; warmlink's Buffer is sized by shapes. So the
warmlink Buffer is built by the first ``dispatch`` (collective, as the constructor is) for that
call's hidden size (rounded up to a multiple of 8: rows move as 8-byte words, so any hidden
size works), the widest top-k seen so far and the most tokens per rank that fit
``num_nvl_bytes`` (``deep_ep.sizing``), on the device of ``x``; every rank computes the same sizes.
A larger batch goes in several rounds (deep_ep.rounds, Note [Rounds beyond the budget]). On CUDA
it is a streamed Buffer (``send="stream"``) within the budget instead, which takes any batch in
one call, keeps its counts on the device (so a padded fresh dispatch can be captured in a CUDA
graph, as DeepEP's can) and needs ~71 MiB at 2 ranks whatever the budget: wherever its CUDA C++
kernels run (ep.kernels.stream_cuda: at most 8 ranks), and with the Triton ones only where the
slots would not hold the largest first batch of any rank in one round (every rank's count through
the rendezvous store when the Buffer is built, so that every rank decides alike). Why streamed
where slots would hold the batch: on 2 x H200 (DeepEP's shape, runs of both in one lease) the
streamed Buffer's fresh dispatch is 10-30% faster than a slot Buffer's of 2e9 bytes (padded, BF16,
FP8), its cached FP8 dispatch 1.5x, its cached BF16 dispatch and combine even, in an eighth of the
memory. The ranks meet over the store ``deep_ep.Buffer``'s constructor made, not in a collective
of the group: a rank that makes no first dispatch costs the others ``TransferTimeout`` within the
Buffer's timeout, naming it, where a collective would wait for it without end.

A later call with a wider hidden size or top-k grows it: the ranks first agree on the new sizes
in a host meet (``ep.Buffer.all_gather_int``: a rank that calls otherwise makes the others time
out, not hang), then the old Buffer is closed and one of the new sizes built within the same
budget (fewer tokens per round). A narrower call is padded with zeros to the Buffer's hidden size
on the way in and cut back on the way out (``widen`` / ``narrow``: a copy each way, for such calls
only), so calls of several widths share one receive space and, once the widest has come, the warm
path builds nothing. A handle of the Buffer before a growth is refused (it names the other
Buffer). A budget that holds not one token of the sizes raises ``ConfigError``, naming the bytes
one needs, before any byte moves.
"""

from __future__ import annotations

import torch

from warmlink.ep import Buffer as EPBuffer
from warmlink.ep.deep_ep import sizing
from warmlink.ep.kernels import stream_cuda
from warmlink.ep.kernels.stream import sm_count
from warmlink.ep.wire.fp8 import num_scales
from warmlink.errors import ConfigError

__all__ = ["built", "narrow", "widen"]

_TOPK_BITS = 16  # a meet value holds hidden << _TOPK_BITS | top-k


def built(owner, rows: torch.Tensor, num_topk: int) -> EPBuffer:
    """The warmlink Buffer of ``owner`` (a ``deep_ep.Buffer``) for a fresh dispatch of ``rows``
    with ``num_topk`` ids per token: ``owner``'s, built or grown when it does not hold them.
    Collective when it builds. Raises ``ConfigError`` (see the module's note)."""
    func = "deep_ep.Buffer.dispatch"
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ConfigError(f"{func}: x must be a [num_tokens, hidden] tensor; got shape {tuple(getattr(rows, 'shape', ()))}")
    hidden, inner = sizing.built_hidden(rows.shape[1]), owner._inner
    if inner is None and owner.num_nvl_bytes == 0:
        raise ConfigError(f"{func}: num_nvl_bytes=0; this Buffer was made for the low-latency calls only, and "
                          "normal-mode dispatch needs a budget (pass num_nvl_bytes from "
                          "Config.get_nvl_buffer_size_hint, as for DeepEP)")
    topk = max(num_topk, owner._widest_topk, 1)
    if inner is not None:
        lay = inner.layout
        if hidden <= lay.hidden and num_topk <= lay.num_topk:
            return inner
        hidden, topk = max(hidden, lay.hidden), max(topk, lay.num_topk)
        wanted = hidden << _TOPK_BITS | topk
        agreed = inner.all_gather_int(wanted)  # every rank grows to the same sizes, or none does
        if any(v != wanted for v in agreed):
            sizes = [(v >> _TOPK_BITS, v & ((1 << _TOPK_BITS) - 1)) for v in agreed]
            raise ConfigError(f"{func}: the ranks would grow the Buffer to different (hidden, num_topk): {sizes}; every "
                              "rank must dispatch the same hidden size and top-k width")
    held = sizing.tokens_within(owner.num_nvl_bytes, owner.group_size, hidden, topk)
    streamed = None
    # streamed wherever the CUDA streamed kernels run; with Triton's, where a slot round would not hold a batch
    if rows.is_cuda and (stream_cuda.choose(rows.device.index, owner.group_size) == "cuda" or held == 0
                         or held < _most_tokens(owner, rows)):
        streamed = sizing.stream_within(owner.num_nvl_bytes, owner.group_size, hidden, topk,
                                        sm_count(rows.device.index) // 2)
    if held == 0 and streamed is None:
        raise sizing.refuse(func, owner.num_nvl_bytes, owner.group_size, hidden, topk)
    if inner is not None:
        if rows.is_cuda:  # the old Buffer's queued work still reads its regions
            torch.cuda.synchronize(rows.device)
        owner._inner = None
        inner.close()
    device, backend = (rows.device.index, None) if rows.is_cuda else (-1, "shm")
    store, rank, size = owner._rendezvous(), owner.rank, owner.group_size
    if streamed is not None:
        channels, ring_rows = streamed
        return EPBuffer(store, rank, size, max_tokens_per_rank=sizing.MAX_TOKENS, hidden=hidden, num_topk=topk,
                        device=device, timeout_s=owner._timeout_s, send="stream", stream_channels=channels,
                        ring_rows=ring_rows)
    return EPBuffer(store, rank, size, max_tokens_per_rank=held, hidden=hidden, num_topk=topk, device=device,
                    backend=backend, timeout_s=owner._timeout_s)


def _most_tokens(owner, rows: torch.Tensor) -> int:
    """The largest batch of any rank of ``owner`` (a ``deep_ep.Buffer``) in this call, from every
    rank's count in its rendezvous store, under keys of their own (every rank asks at the same
    builds). Raises ``TransferTimeout`` (a rank that made no call) or ``MetadataError`` (a count that
    is not one)."""
    from warmlink.errors import MetadataError

    store = owner._rendezvous()
    owner._exchanges += 1
    key = f"deep_ep/most/{owner._exchanges}"
    store.set(f"{key}/{owner.rank}", str(rows.shape[0]).encode("ascii"), timeout_s=owner._timeout_s)
    most = 1
    for r in range(owner.group_size):
        raw = store.get(f"{key}/{r}", timeout_s=owner._timeout_s, peer=f"deep_ep rank {r}")
        text = raw.decode("ascii", "replace")
        if not text.isdigit() or len(text) > 12:
            raise MetadataError(f"deep_ep.Buffer.dispatch: rank {r}'s token count under {key!r} is {text[:40]!r}; "
                                "expected a decimal count")
        most = max(most, int(text))
    return most


def widen(tokens, hidden: int):
    """``(tokens, width)``: ``tokens`` (``[T, W]`` rows, or an FP8 pair of values and float32
    scales) padded with zeros to ``hidden`` columns (the scales to ``hidden``'s count), and the
    call's own width ``W``; ``tokens`` itself when it is that wide."""
    values = tokens[0] if isinstance(tokens, tuple) else tokens
    width = values.shape[1]
    scales = tokens[1] if isinstance(tokens, tuple) else None
    if width >= hidden or (scales is not None and (
            not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (values.shape[0], num_scales(width)))):
        return tokens, width  # as wide already, or scales that ep's checks refuse by name
    size = values.element_size()  # moved as bytes: there is no copy kernel for float8 types
    wide = torch.zeros(values.shape[0], hidden * size, dtype=torch.uint8, device=values.device)
    if values.shape[0]:  # (an empty tensor may have strides no byte view takes)
        wide[:, :width * size] = values.contiguous().view(torch.uint8)
    wide = wide.view(values.dtype)
    if not isinstance(tokens, tuple):
        return wide, width
    wide_scales = scales.new_zeros(values.shape[0], num_scales(hidden))
    wide_scales[:, :scales.shape[1]] = scales
    return (wide, wide_scales), width


def narrow(out, width: int):
    """``(out, cut)``: ``out`` (rows, or an FP8 pair) cut back to ``width`` columns as fresh tensors
    (``cut`` True), or ``out`` itself when it is that wide."""
    values = out[0] if isinstance(out, tuple) else out
    if values.shape[1] == width:
        return out, False
    if values.shape[0]:
        cut = values.contiguous().view(torch.uint8)[:, :width * values.element_size()].contiguous().view(values.dtype)
    else:  # (an empty tensor may have strides no byte view takes)
        cut = torch.empty(0, width, dtype=values.dtype, device=values.device)
    if not isinstance(out, tuple):
        return cut, True
    return (cut, out[1][:, :num_scales(width)].contiguous()), True
