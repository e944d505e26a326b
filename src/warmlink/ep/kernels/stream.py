"""A dispatch whose rows stream through rings the GPUs pace themselves: the entry point, its torch twin,
and the size of the space it needs (ep.kernels.stream_programs holds the kernel).

ep.paths.streamed launches it for a Buffer built with ``send="stream"``.

# Note [Streamed dispatch]
Why: the slot design (ep.wire.regions) gives every (source rank, token) a receive row, R *
max_tokens rows per rank and parity. At DeepEP's memory budget (its ``get_nvl_buffer_size_hint``,
about 7x smaller) that does not fit, so a batch is split into host-driven rounds, 8-17x slower
than DeepEP. Here the receive space is fixed, ``R * C * ring_rows`` rows whatever the batch
(``stream_nbytes``), and rows stream through it with credits the GPUs check themselves: no host
stands between the devices during a call.

Space (int64 words of one allocation per rank, mapped by every peer; ``StreamSpace``): ``tails[s][c]``
(written by source s's sender program c), ``heads[d][c]`` (written by destination d's receiver
program c: this rank is the sender there), each on a 128-byte line of its own, then
``rings[s][c]``: ``ring_rows`` rows of ``row_words`` words for the rows source s sends this rank on
channel c. A row is the token's x words, its meta words (ids at ``[0, k)``, float32 weights at
``2k``, scales at ``3k``, as ep.wire.regions' meta rows with K = k) and one word: its ordinal
among the rows its source sends this rank (``plan``'s ``rows[t, d] - d * max_tokens``); ``row_words``
pads a row to whole 128-byte lines, so that rows move in 16-byte accesses.

One launch per rank and call, grid ``2C``: sender program c takes tokens ``[c * ceil(T/C), ...)``
in order, a tile of ``tokens`` (8) per step: a token's row to destination d goes to
``rings[me][c][count % ring_rows]`` in d's memory, ``count`` being d's rows before it (a cumulative
sum over the tile). One credit check per step: the step takes the tile's tokens up to the first
whose row finds no free slot in its ring (after one read of the heads of rings short of room), so
a ring smaller than a tile works; when not even the first fits, it waits for that one's credits.
It then moves the taken tokens as ``[tokens, x_block]`` blocks of words, and their meta and
ordinals, into every destination's slots with masks, and every ``publish`` rows (and before any
wait, so that the rows it waits on can be taken) publishes ``tails[me][c]`` in d's memory:
``seq << 32 | count``, stored by one thread after a block barrier and its system fence; at the
end ``seq << 32 | FIN | count`` (FIN = 1 << 31) to every destination, also one it sent nothing.
Receiver program c visits the sources round-robin (a slow source holds up no other), takes each
one's new rows (at most ``batch`` a visit, ``tokens`` rows a block: their ordinals a vector, then
``[tokens, x_block]`` blocks) into ``out[recv_offset[s] + ordinal]`` (ids made local, -1
elsewhere; weights 0 where the id is not local; scales as sent), and gives credits back with one
store a visit of
``heads[me][c]`` in the source's memory: ``seq << 32 | taken``, with FIN once the source's FIN
came and all its rows are taken. It ends when every source is FIN and taken. The order is the
non-streamed dispatch's exactly: by source rank, then source token (a row's place comes from its
ordinal, not from when it arrives). At its end receiver program c writes ``taken[s, c]``, the rows it
took from source s: where the streamed combine (ep.kernels.stream_combine) finds the rows it sends back.

Why tiles: the first version moved one row per step (scalar branches per destination, one row
copy per receiver step) and each program was bound by the latency of a step, not by bandwidth:
on one H200, one rank to itself, 4096 tokens of 7168 BF16 top-8 (a flat copy: 33 us) took 996
us at 10 channels, 542 at 20, 227 at 64, whatever the ring, the warps or the publish interval.
DeepEP moves these rows at about 20 GB/s a channel; a step of many rows puts that many loads in
flight at once.

Credits: row i of a call goes to slot ``i % ring_rows`` only once ``i - taken < ring_rows``, with
``taken`` from a head the receiver published (barrier, one thread's system fence, store) after
reading rows below ``taken``, and read by the sender with an acquire: the row the slot held was
read. The receiver reads rows only below a tail's count, read with an acquire; the sender
published it after the rows' stores (barrier, one thread's system fence, store). Ring loads
bypass L1: a slot holds another row on the next lap.

The seq rule, so that nothing is reset between calls: every rank calls with seq 1, 2, 3, ... (the
space zeroed once before seq 1). A tail of another seq counts as nothing sent this call. A sender
of call ``seq`` first waits, per destination and channel, for a head that is ``seq - 1`` with
FIN (the destination took every row of the previous call, and read its last tail), or the zero
word when ``seq`` is 1, or ``seq`` itself; only then may it write that ring or tail. Its
credits are the taken count of a head of ``seq``, 0 before the receiver took any. Safe: a
receiver of call ``seq - 1`` publishes FIN only after its last read of that ring and tail, so the
sender never overwrites a row or a tail still to be read; and it publishes heads of ``seq`` only
after seeing a tail of ``seq``, which the sender writes only after that wait. A head of ``seq - 1``
without FIN, or of an older or later seq, is not ready: the sender waits, then fails. After a
failed call the rings hold rows of unknown state: zero the space on every rank and restart at 1.

Deadlines: every wait (a sender's for the previous call and for credits, a receiver's for rows:
no progress from any source) ends after ``timeout_s`` of the device clock, or at once when the
int64 at ``abort`` is ``seq`` or more (the host ends a call, or every call queued, without a
race against the seq the device runs). The program then stops and writes its status word
``seq << 32 | aborted << 24 | wait << 16 | peer`` (``failures`` reads them); a program that
finishes writes ``seq << 32``. A failed sender publishes no FIN, so its peers' receivers fail too.
All 2C programs of a rank must be resident at once (a sender spins while a receiver of its own
rank may be the one that frees a slot), so C is at most half the SMs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.kernels.launch import launch
from warmlink.errors import ConfigError

__all__ = ["COUNTER_WORDS", "FIN", "Failure", "Sources", "StreamOutputs", "StreamSpace", "failures",
           "meta_words", "outputs", "recv_offsets", "row_words", "seq_word",
           "stream_dispatch", "stream_dispatch_torch", "stream_nbytes"]

COUNTER_WORDS = 16  # int64 words of one tail or head: a 128-byte line each
LINE_WORDS = 16  # a ring row is a whole number of 128-byte lines
FIN = 1 << 31
PUBLISH_ROWS = 16  # a sender's tail goes out every this many rows to a destination
BATCH_ROWS = 16  # the most rows a receiver takes from one source per visit (one head store)
TILE_TOKENS = 8  # tokens a sender takes per step, rows a receiver copies per step
X_BLOCK_WORDS = 1024  # int64 words of a row per step
NUM_WARPS = 8
WAITS = {0: "done", 1: "previous call", 2: "credit", 3: "rows", 4: "bad row", 5: "posted outputs"}


@dataclass(frozen=True)
class StreamSpace:
    """Where things lie in one rank's stream space, in int64 words (Note [Streamed dispatch])."""

    num_ranks: int
    channels: int
    ring_rows: int
    row_words: int

    def __post_init__(self) -> None:
        for name in ("num_ranks", "channels", "ring_rows", "row_words"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ep.kernels.stream: {name}={value!r}; expected an int > 0")

    def tail(self, source: int, channel: int) -> int:
        return (source * self.channels + channel) * COUNTER_WORDS

    def head(self, dest: int, channel: int) -> int:
        return (self.num_ranks * self.channels + dest * self.channels + channel) * COUNTER_WORDS

    def ring(self, source: int, channel: int) -> int:
        rings = 2 * self.num_ranks * self.channels * COUNTER_WORDS
        return rings + (source * self.channels + channel) * self.ring_rows * self.row_words

    @property
    def nbytes(self) -> int:
        return self.ring(self.num_ranks, 0) * 8


def stream_nbytes(num_ranks: int, channels: int, ring_rows: int, row_words: int) -> int:
    """Bytes of stream space one rank holds: its rings (one per source and channel) and counters."""
    return StreamSpace(num_ranks, channels, ring_rows, row_words).nbytes


def meta_words(num_k: int, num_scales: int) -> int:
    """int64 words of a row's meta part: k ids, k float32 weights (at float 2k), the scales (at 3k)."""
    return -(-(3 * num_k + num_scales) // 2)


def row_words(x_words: int, num_k: int, num_scales: int) -> int:
    """int64 words of a ring row: x, meta, and the row's ordinal, padded to 128-byte lines (so that
    the kernel moves rows in 16-byte accesses, each row starting a line)."""
    return -(-(x_words + meta_words(num_k, num_scales) + 1) // LINE_WORDS) * LINE_WORDS


class StreamOutputs(NamedTuple):
    """A receiver's rows: ``x`` ``[N, W]`` int64 words, ``idx`` ``[N, k]`` int64 local expert ids,
    ``weights`` ``[N, k]`` float32, ``scales`` ``[N, S]`` float32 (None for parts not sent)."""

    x: torch.Tensor
    idx: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    scales: torch.Tensor | None = None


def outputs(n: int, src: Sources, device=None) -> StreamOutputs:
    """Empty outputs of ``n`` rows for rows shaped like ``src``'s."""
    device = device if device is not None else src.x.device
    k = src.topk.shape[1] if src.topk is not None else 0
    return StreamOutputs(torch.empty(n, src.x.shape[1], dtype=torch.int64, device=device),
                         torch.empty(n, k, dtype=torch.int64, device=device) if src.topk is not None else None,
                         torch.empty(n, k, dtype=torch.float32, device=device) if src.weights is not None else None,
                         torch.empty(n, src.scales.shape[1], dtype=torch.float32, device=device)
                         if src.scales is not None else None)


def recv_offsets(counts: list[int], device=None) -> tuple[torch.Tensor, int]:
    """``(offsets [R] int64, total)``: where each source's rows start, from the rows each sends."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return torch.tensor(starts, dtype=torch.int64, device=device), sum(counts)


class Failure(NamedTuple):
    """A program whose status word is not ``seq << 32``: ``wait`` names what it waited on
    (``WAITS``; ``"not run"`` for a word of another call), ``peer`` the rank it waited on."""

    program: int
    role: str
    channel: int
    seq: int
    wait: str
    peer: int
    aborted: bool


def failures(status: torch.Tensor, seq: int, channels: int) -> list[Failure]:
    """The programs of call ``seq`` that did not finish, from the ``[2C]`` status words."""
    out = []
    for p, word in enumerate(status.tolist()[:2 * channels]):
        if word == seq << 32:
            continue
        role, channel = ("send", p) if p < channels else ("recv", p - channels)
        code = word & 0xFFFFFFFF
        wait = WAITS.get(code >> 16 & 0xFF, "unknown") if word >> 32 == seq else "not run"
        out.append(Failure(p, role, channel, word >> 32, wait, code & 0xFFFF, bool(code >> 24 & 1)))
    return out


@functools.cache
def _kernel():
    from warmlink.ep.kernels import stream_programs
    from warmlink.ep.kernels.launch import FastLaunch

    return FastLaunch(stream_programs.stream_dispatch_kernel)


@functools.cache
def sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def no_abort(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)  # never a call's seq


@functools.cache
def _no_taken(device: torch.device, num_ranks: int, channels: int) -> torch.Tensor:
    return torch.zeros(num_ranks, channels, dtype=torch.int64, device=device)  # written, never read


@functools.cache
def _always(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.int64, device=device)  # every round valid


def seq_word(func: str, seq, device: torch.device) -> torch.Tensor:
    """``seq`` as the int64 device word a kernel reads: itself if it is one, else a new one."""
    if isinstance(seq, torch.Tensor):
        if seq.dtype != torch.int64 or seq.numel() != 1 or seq.device != device:
            raise ConfigError(f"{func}: seq {tuple(seq.shape)} {seq.dtype} on {seq.device}; expected one int64 on {device}")
        return seq
    if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq < 1 << 31:
        raise ConfigError(f"{func}: seq={seq!r}; expected 1 <= seq < 2**31")
    return torch.full((1,), seq, dtype=torch.int64, device=device)


def pow2(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def stream_dispatch(space: StreamSpace, rows: torch.Tensor, src: Sources, out: StreamOutputs, recv_offset: torch.Tensor,
                    bases: torch.Tensor, status: torch.Tensor, *, me: int, seq: int, max_tokens: int,
                    experts_per_rank: int, timeout_s: float, abort: int = 0, role: str = "both",
                    publish: int = PUBLISH_ROWS, batch: int = BATCH_ROWS, tokens: int = TILE_TOKENS,
                    x_block: int = X_BLOCK_WORDS, kernel=None, num_warps: int = NUM_WARPS,
                    taken: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> None:
    """Launch rank ``me``'s streamed dispatch of call ``seq`` (Note [Streamed dispatch]).

    Args:
        space: the group's stream space layout (every rank's space is ``space.nbytes``, zeroed once).
        rows: ``plan``'s ``[T, R]`` rows. src: the tokens (x as int64 words) and their meta parts;
            scales with any strides (ep.kernels.steps, Note [Scales in place]); weights need ids.
        out: the receiver's outputs, N rows. recv_offset: ``[R]`` int64, rows from lower sources.
        bases: ``[R]`` int64, the byte address of every rank's space in this process (this one's too),
            each 16-byte aligned (an allocation's start is; the kernel assumes it).
        status: ``[2C]`` int64, each program's status word (``failures``).
        seq: this call's number, 1, 2, ... on every rank: an int, or an int64 device word the kernel
            reads when it runs (so that a CUDA graph's replays each run a call of their own: ``advance``).
        max_tokens: ``plan``'s slot size.
        timeout_s: each wait's deadline on the device clock. abort: byte address of an int64 that,
            set to ``seq`` or more, ends every wait (0: none).
        role: ``"both"``, or ``"send"`` / ``"recv"`` alone (tests: the interpreter runs programs in order).
        publish, batch: rows between a sender's tail stores; rows a receiver takes per visit.
        tokens, x_block: the step's tile, ``[tokens, x_block]`` int64 words (powers of 2).
        kernel: a Triton kernel to launch instead (the interpreter's, in tests), or ``"cuda"``: the CUDA
            C++ kernel (ep.kernels.stream_cuda; role ``"both"`` only). num_warps: 0, Triton's.
        taken: ``[R, C]`` int64, contiguous, or None: receiver program c writes ``taken[s, c]``, the rows it
            took from source s (the streamed combine's input, ep.kernels.stream_combine).
        valid: an int64 device word read at launch's run, or None (1): 0 sends no token, only FIN (a round
            the count exchange refused: every rank then receives nothing, and no rank waits).
    """
    r, c = space.num_ranks, space.channels
    if role not in ("both", "send", "recv"):
        raise ConfigError(f"stream_dispatch: role={role!r}; expected 'both', 'send' or 'recv'")
    seq = seq_word("stream_dispatch", seq, rows.device)
    for name, value in (("tokens", tokens), ("x_block", x_block)):
        if value < 1 or value & (value - 1):
            raise ConfigError(f"stream_dispatch: {name}={value}; expected a power of 2")
    if publish < 1 or batch < 1:
        raise ConfigError(f"stream_dispatch: publish={publish}, batch={batch}; expected >= 1")
    if rows.dim() != 2 or rows.shape[1] != r or src.x.dtype != torch.int64 or src.x.shape[0] != rows.shape[0]:
        raise ConfigError(f"stream_dispatch: rows {tuple(rows.shape)}, x {tuple(src.x.shape)} {src.x.dtype}; "
                          f"expected [T, {r}] rows and [T, W] int64 x")
    if src.weights is not None and src.topk is None:
        raise ConfigError("stream_dispatch: weights without topk ids; expected ids with the weights")
    num_tokens, x_words = src.x.shape
    num_k = src.topk.shape[1] if src.topk is not None else 0
    num_scales = src.scales.shape[1] if src.scales is not None else 0
    need = x_words + meta_words(num_k, num_scales) + 1
    if need > space.row_words:
        raise ConfigError(f"stream_dispatch: rows of {need} words; the space holds {space.row_words}")
    n = out.x.shape[0]
    for name, part, want, cols in (("idx", out.idx, src.topk, num_k), ("weights", out.weights, src.weights, num_k),
                                   ("scales", out.scales, src.scales, num_scales)):
        wrong = part is not None and (part.shape != (n, cols) or not part.is_contiguous())
        if (part is None) != (want is None) or wrong:
            raise ConfigError(f"stream_dispatch: out.{name} {None if part is None else tuple(part.shape)}; "
                              f"expected {None if want is None else (n, cols)}, contiguous")
    if out.x.shape[1] != x_words or bases.numel() != r or recv_offset.numel() != r or status.numel() < 2 * c:
        raise ConfigError(f"stream_dispatch: out.x {tuple(out.x.shape)}, bases {bases.numel()}, recv_offset "
                          f"{recv_offset.numel()}, status {status.numel()}; "
                          f"expected [N, {x_words}], {r}, {r}, >= {2 * c}")
    if taken is not None and (taken.shape != (r, c) or taken.dtype != torch.int64 or not taken.is_contiguous()):
        raise ConfigError(f"stream_dispatch: taken {tuple(taken.shape)} {taken.dtype}; expected [{r}, {c}] int64, "
                          f"contiguous")
    if rows.is_cuda and 2 * c > sm_count(rows.device.index):
        raise ConfigError(f"stream_dispatch: {c} channels; 2 programs each must be resident at once, at most "
                          f"{sm_count(rows.device.index) // 2}")
    if kernel in (None, "cuda") and not rows.is_cuda:
        raise ConfigError("stream_dispatch: CPU tensors and no kernel; the streamed dispatch runs on CUDA")
    if valid is not None and (valid.dtype != torch.int64 or valid.numel() < 1):
        raise ConfigError(f"stream_dispatch: valid {tuple(valid.shape)} {valid.dtype}; expected an int64 word")
    x, topk, w = (t.contiguous() if t is not None else None for t in (src.x, src.topk, src.weights))
    s_strides = tuple(src.scales.stride()) if src.scales is not None else (0, 0)
    first, programs = {"both": (0, 2 * c), "send": (0, c), "recv": (c, c)}[role]
    abort = abort or no_abort(rows.device).data_ptr()
    block = min(x_block, pow2(x_words))
    valid = valid if valid is not None else _always(rows.device)
    taken = taken if taken is not None else _no_taken(rows.device, r, c)
    args = (rows.contiguous(), x, topk if topk is not None else rows, w if w is not None else rows,
            src.scales if src.scales is not None else rows, bases, recv_offset, out.x,
            *(p if p is not None else out.x for p in (out.idx, out.weights, out.scales)), status, abort, valid, me, seq,
            num_tokens, max_tokens, x_words, num_k, num_scales, *s_strides, meta_words(num_k, num_scales),
            space.row_words, space.ring_rows, n, experts_per_rank, int(timeout_s * 1e9), first, taken)
    if kernel == "cuda":  # the CUDA C++ kernel (ep.kernels.stream_cuda, Note [Warp groups])
        if role != "both" or rows.dtype != torch.int64:
            raise ConfigError(f"stream_dispatch: kernel='cuda' with role={role!r}, rows {rows.dtype}; expected "
                              "'both' and int64 rows")
        from warmlink.ep.kernels import stream_cuda

        stream_cuda.dispatch(space, args[0], x, topk, w, src.scales, bases, recv_offset, out, status, abort,
                             valid, me, seq, max_tokens, meta_words(num_k, num_scales), experts_per_rank,
                             int(timeout_s * 1e9), taken, publish, batch)
        return
    launch(kernel or _kernel(), (programs,), args, {
        "NUM_RANKS": r, "CHANNELS": c, "R_BLOCK": max(2, 1 << max(0, r - 1).bit_length()), "X_BLOCK": block,
        "CHUNKS": -(-x_words // block), "K_BLOCK": pow2(num_k), "S_BLOCK": pow2(num_scales),
        "HAS_TOPK": topk is not None, "HAS_W": w is not None, "HAS_S": src.scales is not None,
        "PUBLISH": publish, "BATCH": batch, "TOKENS": tokens}, num_warps=num_warps)


def stream_dispatch_torch(me: int, rows_of: list[torch.Tensor], sources_of: list[Sources], max_tokens: int,
                          experts_per_rank: int, taken: torch.Tensor | None = None) -> StreamOutputs:
    """Rank ``me``'s outputs of a streamed dispatch, from every rank's ``plan`` rows and sources: the
    kernel's reference. Row ``recv_offset[s] + rows_of[s][t, me] - me * max_tokens`` is source s's
    token t: by source, then source token, as the non-streamed dispatch. ``taken`` (``[R, C]``), when
    given, gets the kernel's: the rows source s sends ``me`` on channel c (tokens ``[c * ceil(T/C), ...)``)."""
    if taken is not None:
        for s, rows in enumerate(rows_of):
            per = -(-rows.shape[0] // taken.shape[1])
            goes = (rows[:, me] >= 0).to(torch.int64)
            taken[s] = torch.stack([goes[c * per:(c + 1) * per].sum() for c in range(taken.shape[1])])
    counts = [int((rows[:, me] >= 0).sum()) for rows in rows_of]
    offsets, total = recv_offsets(counts)
    out = outputs(total, sources_of[0])
    base = me * experts_per_rank
    for s, (rows, src) in enumerate(zip(rows_of, sources_of, strict=True)):
        col = rows[:, me]
        tokens = torch.nonzero(col >= 0).view(-1)
        at = col.index_select(0, tokens) - me * max_tokens + int(offsets[s])
        out.x.index_copy_(0, at, src.x.index_select(0, tokens))
        if src.topk is not None:
            raw = src.topk.index_select(0, tokens).to(torch.int64)
            local = raw - base
            here = (raw >= 0) & (local >= 0) & (local < experts_per_rank)
            out.idx.index_copy_(0, at, torch.where(here, local, -1))
            if src.weights is not None:
                w = src.weights.index_select(0, tokens).float()
                out.weights.index_copy_(0, at, torch.where(here, w, 0.0))
        if src.scales is not None:
            out.scales.index_copy_(0, at, src.scales.index_select(0, tokens).float())
    return out
