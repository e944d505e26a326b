"""The streamed dispatch's way back: every expert rank's rows return through the same stream space and
each source sums its tokens' copies as they arrive. The entry point, its torch twin and the row
size (ep.kernels.stream_combine_programs holds the kernel).

ep.paths.streamed launches it for a Buffer built with ``send="stream"``.

# Note [Streamed combine]
Why: the same budget as the dispatch's (Note [Streamed dispatch], ep.kernels.stream). The slot
combine gives every (expert rank, token) copy a row at its source, ``R * max_tokens`` rows per
rank; here the copies stream back through the rings the dispatch used, ``R * C * ring_rows`` rows
whatever the batch, and the source sums them into its output as they come: no combine area.

Protocol: the dispatch's, the other way round, through the same ``StreamSpace``: the dispatch and
the combine alternate in one space with one seq count (dispatch 1, combine 2, dispatch 3, ...), and
every rule of the dispatch holds (a sender first waits for a head of ``seq - 1`` with FIN, credits
are the taken count of a head of ``seq``, FIN to every peer and channel, every wait ends at the
device deadline or the abort word, a status word per program, ``failures`` reads them). Grid
``2C``; the dispatch's receiver program c wrote ``taken[s, c]``, the rows it took from source s.

Sender program c at an expert rank: for every source s, the rows its dispatch channel c took
from s, ``x[offset[s] + P[s][c] : ... + taken[s][c]]`` (``P``: the rows of s on lower channels;
the dispatch placed s's rows in s's token order, and channel c carried s's tokens ``[c *
ceil(T_s / C), ...)``), in that order into s's ``rings[me][c]``, ``publish`` rows at a time, the
tail after each; round-robin over the sources, so a source slow to give credits holds up no other.
A row: x's words, then (with weights) the K float32 weights at float ``2 * x_words`` on.

Receiver program c at a source: its tokens ``[c * ceil(T / C), ...)`` in order, in tiles of
``min(batch, ring_rows)`` tokens (so a tile needs at most a ring of rows from any rank). Token t
has a copy from every rank d with ``rows[t, d] >= 0`` (``plan``'s rows, kept by the source); the
tile's copies from d are d's next rows on ``rings[d][c]`` in token order, placed by a cumsum over
the tile. The program waits until every rank's tail counts the tile's rows, sums each token's
copies in float32 in rank order d = 0..R-1 (zeros for a token sent nowhere), stores them in x's
dtype with the weights' float32 sums, and gives the tile's credits back (a head per rank). At the
end it waits for every rank's FIN (a rank that sent fewer rows than the tokens need, or more, is
a ``bad row``) and publishes FIN heads.

Why channels are the source's token ranges: a token's copies then all come on one channel, each
in its rank's ring, so one program sums a token whole, in rank order, whenever its copies come:
the sum is the same bits every run, and those of the slot combine (ep.kernels.reduce) and of the
oracle. The expert rank's own copies go through its own rings too, as the dispatch's.
"""

from __future__ import annotations

import functools

import torch

from warmlink.ep.kernels.launch import launch
from warmlink.ep.kernels.stream import BATCH_ROWS, PUBLISH_ROWS, StreamSpace, no_abort, pow2, seq_word, sm_count
from warmlink.errors import ConfigError

__all__ = ["combine_row_words", "stream_combine", "stream_combine_torch"]

_X_BLOCK = 1024  # int64 words of a row a sender moves per step
_H_BLOCK = 512  # elements of a row a receiver sums per step
_DTYPES = (torch.bfloat16, torch.float16)


def combine_row_words(x_words: int, num_k: int) -> int:
    """int64 words of a combine row: x, then ``num_k`` float32 weights (0 without weights)."""
    return x_words + -(-num_k // 2)


@functools.cache
def _kernel():
    from warmlink.ep.kernels import stream_combine_programs
    from warmlink.ep.kernels.launch import FastLaunch

    return FastLaunch(stream_combine_programs.stream_combine_kernel)


def _check(name: str, t: torch.Tensor | None, shape: tuple, dtype, where: str) -> None:
    if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        got = None if t is None else f"{tuple(t.shape)} {t.dtype}"
        raise ConfigError(f"stream_combine: {name} {got}; expected {list(shape)} {dtype}, contiguous ({where})")


def stream_combine(space: StreamSpace, rows: torch.Tensor, x: torch.Tensor, out: torch.Tensor, taken: torch.Tensor,
                   recv_offset: torch.Tensor, bases: torch.Tensor, status: torch.Tensor, *, me: int, seq,
                   timeout_s: float, weights: torch.Tensor | None = None, out_weights: torch.Tensor | None = None,
                   abort: int = 0, role: str = "both", publish: int = PUBLISH_ROWS, batch: int = BATCH_ROWS,
                   kernel=None, num_warps: int = 0) -> None:
    """Launch rank ``me``'s streamed combine of call ``seq`` (Note [Streamed combine]).

    Args:
        space: the stream space the dispatch used (``row_words`` at least ``combine_row_words``).
        rows: ``[T, R]`` this rank's ``plan`` rows of the dispatch it combines (as a source).
        x: ``[N, H]`` BF16 or FP16, row i the expert output of the dispatch's output row i here.
        out: ``[T, H]`` x's dtype: each token's copies summed (float32, rank order), zeros if none.
        taken, recv_offset: ``[R, C]`` and ``[R]`` int64, the dispatch's here (``stream_dispatch``'s
            ``taken`` and ``recv_offset``).
        bases: ``[R]`` int64 byte addresses of every rank's space. status: ``[2C]`` int64 status words.
        seq: this call's number: one more than the dispatch's (the two share the count); an int or an
            int64 device word, as ``stream_dispatch``'s.
        weights, out_weights: ``[N, K]`` and ``[T, K]`` float32, both or neither: summed as x.
        timeout_s, abort, role, kernel, num_warps: as ``stream_dispatch``'s (``kernel="cuda"``: the CUDA
            C++ kernel).
        publish, batch: rows a sender moves between tail stores; a receiver's tile of tokens (powers of 2).
    """
    r, c = space.num_ranks, space.channels
    if role not in ("both", "send", "recv"):
        raise ConfigError(f"stream_combine: role={role!r}; expected 'both', 'send' or 'recv'")
    seq = seq_word("stream_combine", seq, x.device)
    for name, value in (("publish", publish), ("batch", batch)):
        if value < 1 or value & (value - 1):
            raise ConfigError(f"stream_combine: {name}={value}; expected a power of 2")
    if x.dim() != 2 or x.dtype not in _DTYPES or x.shape[1] % 4 or not x.is_contiguous():
        raise ConfigError(f"stream_combine: x {tuple(x.shape)} {x.dtype}; expected [N, H] bfloat16 or float16, "
                          f"H a multiple of 4, contiguous")
    if rows.dim() != 2 or rows.shape[1] != r or rows.dtype != torch.int64:
        raise ConfigError(f"stream_combine: rows {tuple(rows.shape)} {rows.dtype}; expected [T, {r}] int64")
    (n, hidden), num_tokens = x.shape, rows.shape[0]
    _check("out", out, (num_tokens, hidden), x.dtype, "a row per token of rows, x's dtype")
    if (weights is None) != (out_weights is None):
        raise ConfigError("stream_combine: weights and out_weights; expected both or neither")
    num_k = 0
    if weights is not None:
        num_k = weights.shape[1] if weights.dim() == 2 else -1
        _check("weights", weights, (n, num_k), torch.float32, "a row per row of x")
        _check("out_weights", out_weights, (num_tokens, num_k), torch.float32, "a row per token of rows")
    _check("taken", taken, (r, c), torch.int64, "the dispatch's")
    _check("recv_offset", recv_offset, (r,), torch.int64, "the dispatch's")
    if bases.numel() != r or status.numel() < 2 * c:
        raise ConfigError(f"stream_combine: bases {bases.numel()}, status {status.numel()}; expected {r}, >= {2 * c}")
    x_words = hidden // 4
    need = combine_row_words(x_words, num_k)
    if need > space.row_words:
        raise ConfigError(f"stream_combine: rows of {need} words; the space holds {space.row_words}")
    if x.is_cuda and 2 * c > sm_count(x.device.index):
        raise ConfigError(f"stream_combine: {c} channels; 2 programs each must be resident at once, at most "
                          f"{sm_count(x.device.index) // 2}")
    if kernel in (None, "cuda") and not x.is_cuda:
        raise ConfigError("stream_combine: CPU tensors and no kernel; the streamed combine runs on CUDA")
    first, programs = {"both": (0, 2 * c), "send": (0, c), "recv": (c, c)}[role]
    abort = abort or no_abort(x.device).data_ptr()
    words = x.view(torch.int64)
    args = (rows, words, weights if weights is not None else words, taken, recv_offset, bases, out,
            out_weights if out_weights is not None else out, status, abort, me, seq, num_tokens, n, x_words, num_k,
            space.row_words, space.ring_rows, int(timeout_s * 1e9), first)
    if kernel == "cuda":  # the CUDA C++ kernel (ep.kernels.stream_cuda, Note [Warp groups])
        if role != "both":
            raise ConfigError(f"stream_combine: kernel='cuda' with role={role!r}; expected 'both'")
        from warmlink.ep.kernels import stream_cuda

        stream_cuda.combine(space, rows.contiguous(), words, weights, taken, recv_offset, bases, out, out_weights,
                            status, abort, me, seq, int(timeout_s * 1e9), publish, batch)
        return
    x_block, h_block = min(_X_BLOCK, pow2(x_words)), min(_H_BLOCK, pow2(hidden))
    launch(kernel or _kernel(), (programs,), args, {
        "NUM_RANKS": r, "CHANNELS": c, "R_BLOCK": max(2, 1 << max(0, r - 1).bit_length()),
        "C_BLOCK": max(2, 1 << max(0, c - 1).bit_length()), "X_BLOCK": x_block, "X_CHUNKS": -(-x_words // x_block),
        "H_BLOCK": h_block, "H_CHUNKS": -(-hidden // h_block), "PER_WORD": 4, "K_BLOCK": pow2(num_k),
        "HAS_W": weights is not None, "PUBLISH": publish, "BATCH": batch}, num_warps=num_warps)


def _copies(me: int, rows: torch.Tensor, d: int, taken: torch.Tensor, offset: int) -> torch.Tensor:
    """``[T]`` the row of rank d's x holding token t's copy (-1: none), from d's ``taken`` as the
    kernel finds it: channel c's copies are rows ``offset + P[c]`` on, in token order."""
    num_tokens, channels = rows.shape[0], taken.shape[1]
    per = -(-num_tokens // channels)
    at = torch.full((num_tokens,), -1, dtype=torch.int64, device="cpu")
    start = offset
    for c in range(channels):
        tokens = torch.nonzero(rows[c * per:(c + 1) * per, d] >= 0).view(-1) + c * per
        if tokens.numel() != int(taken[me, c]):
            raise ValueError(f"stream_combine_torch: rank {d} took {int(taken[me, c])} rows of rank {me} on channel "
                             f"{c}; its tokens send {tokens.numel()}")
        at[tokens] = start + torch.arange(tokens.numel(), device="cpu")
        start += tokens.numel()
    return at


def stream_combine_torch(me: int, rows: torch.Tensor, xs: list[torch.Tensor], taken_of: list[torch.Tensor],
                         offsets_of: list[torch.Tensor], weights_of: list[torch.Tensor] | None = None):
    """Rank ``me``'s ``(out [T, H], out_weights [T, K] or None)`` of a streamed combine, from its
    ``plan`` rows and every rank d's x, ``taken`` and ``recv_offset`` (and weights): the kernel's
    reference. Float32 sums in rank order, cast to x's dtype: those of ep.kernels.reduce."""
    rows = rows.cpu()
    num_tokens = rows.shape[0]
    acc = torch.zeros(num_tokens, xs[0].shape[1], dtype=torch.float32, device="cpu")
    wsum = None if weights_of is None else torch.zeros(num_tokens, weights_of[0].shape[1], dtype=torch.float32,
                                                       device="cpu")
    for d in range(len(xs)):  # rank order: deterministic
        at = _copies(me, rows, d, taken_of[d].cpu(), int(offsets_of[d][me]))
        here = (at >= 0).unsqueeze(1)
        if not here.any():
            continue
        # select, never multiply by 0: a token without a copy there reads row 0
        acc += torch.where(here, xs[d].cpu().index_select(0, at.clamp(min=0)).float(), 0.0)
        if wsum is not None:
            wsum += torch.where(here, weights_of[d].cpu().index_select(0, at.clamp(min=0)).float(), 0.0)
    return acc.to(xs[0].dtype), wsum
