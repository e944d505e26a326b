"""The Triton kernel of the streamed combine (ep.kernels.stream_combine launches it; Note [Streamed
combine] there). It shares the streamed dispatch's space, counters and helpers (ep.kernels.stream_programs).

Imported only where Triton is. ``device_clock_ns`` and ``fence_system`` are names of this module
too (and ``ended`` and ``publish`` call them through ep.kernels.stream_programs): tests swap both
modules' for the interpreter.
"""

import triton
import triton.language as tl

from warmlink.ep.kernels.stream_programs import (
    ABORT_POLL_NS, BAD_ROW, COUNT_MASK, COUNTER, FIN, W_CREDIT, W_ROWS, device_clock_ns, ended, fence_system, first,
    head_state, previous_taken, publish, publish_one, space_of)

__all__ = ["stream_combine_kernel", "fence_system"]


@triton.jit(do_not_specialize=["num_tokens", "x_rows", "first_program"])
def stream_combine_kernel(rows_ptr, x_ptr, w_ptr, taken_ptr, offsets_ptr, bases_ptr, out_ptr, out_w_ptr, status_ptr,
                          abort_ptr, me, seq_ptr, num_tokens, x_rows, x_words, num_k, row_words, ring_rows, timeout_ns,
                          first_program,
                          NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr,
                          C_BLOCK: tl.constexpr, X_BLOCK: tl.constexpr, X_CHUNKS: tl.constexpr, H_BLOCK: tl.constexpr,
                          H_CHUNKS: tl.constexpr, PER_WORD: tl.constexpr, K_BLOCK: tl.constexpr, HAS_W: tl.constexpr,
                          PUBLISH: tl.constexpr, BATCH: tl.constexpr):
    # program p < CHANNELS sends back the rows dispatch channel p took here, program CHANNELS + c
    # sums the copies of this rank's tokens of channel c; ``first_program`` as the dispatch's
    p = tl.program_id(0) + first_program
    seq64 = tl.load(seq_ptr)
    if p < CHANNELS:
        status = combine_send(x_ptr, w_ptr, taken_ptr, offsets_ptr, bases_ptr, abort_ptr, p, me, seq64, x_rows,
                              x_words, num_k, row_words, ring_rows, timeout_ns, NUM_RANKS, CHANNELS, R_BLOCK, C_BLOCK,
                              X_BLOCK, X_CHUNKS, K_BLOCK, HAS_W, PUBLISH)
    else:
        status = combine_recv(rows_ptr, bases_ptr, out_ptr, out_w_ptr, abort_ptr, p - CHANNELS, me, seq64, num_tokens,
                              x_words, num_k, row_words, ring_rows, timeout_ns, NUM_RANKS, CHANNELS, R_BLOCK, H_BLOCK,
                              H_CHUNKS, PER_WORD, K_BLOCK, HAS_W, BATCH)
    tl.store(status_ptr + p, (seq64 << 32) | status)


@triton.jit
def pick(values, r, s):
    # element s of a [R_BLOCK] vector, as a scalar
    return tl.sum(tl.where(r == s, values, 0), 0)


@triton.jit
def ring_of(own, d, c, ring_rows, row_words, NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr):
    # rings[d][c] of this rank's space: the rows rank d sends here on channel c
    return own + 2 * NUM_RANKS * CHANNELS * COUNTER + ((d * CHANNELS + c) * ring_rows).to(tl.int64) * row_words


@triton.jit
def combine_send(x_ptr, w_ptr, taken_ptr, offsets_ptr, bases_ptr, abort_ptr, c, me, seq64, x_rows, x_words, num_k,
                 row_words, ring_rows, timeout_ns,
                 NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr,
                 X_BLOCK: tl.constexpr, X_CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr, HAS_W: tl.constexpr,
                 PUBLISH: tl.constexpr):
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    heads = space_of(bases_ptr, me) + NUM_RANKS * CHANNELS * COUNTER + (r * CHANNELS + c) * COUNTER
    tails = tl.load(bases_ptr + r, mask=rm, other=0).to(tl.pointer_type(tl.int64)) + (me * CHANNELS + c) * COUNTER
    rings = 2 * NUM_RANKS * CHANNELS * COUNTER + ((me * CHANNELS + c) * ring_rows).to(tl.int64) * row_words
    # 1. every source took the previous call's rows of this channel (as the dispatch's sender)
    consumed, status = previous_taken(heads, rm, r, seq64, timeout_ns, abort_ptr, R_BLOCK)
    # 2. source s's rows of this channel: [offset[s] + P[s][c], + taken[s][c]) of x, P the rows of
    # the lower channels (the dispatch placed a source's rows in its token order, channel by channel)
    ch = tl.arange(0, C_BLOCK)
    took = tl.load(taken_ptr + r[:, None] * CHANNELS + ch[None, :], mask=rm[:, None] & (ch < CHANNELS)[None, :],
                   other=0).to(tl.int64)
    n = tl.sum(tl.where(ch[None, :] == c, took, 0), 1)
    lo = tl.load(offsets_ptr + r, mask=rm, other=0).to(tl.int64) + tl.sum(tl.where(ch[None, :] < c, took, 0), 1)
    if status == 0:
        outside = rm & ((lo < 0) | (n < 0) | (lo + n > x_rows))
        if tl.sum(outside.to(tl.int32), 0) > 0:
            status = tl.zeros([], dtype=tl.int64) + ((BAD_ROW << 16) | first(outside, r))
    sent = tl.zeros([R_BLOCK], dtype=tl.int64)
    i = tl.arange(0, PUBLISH)
    kc = tl.arange(0, K_BLOCK)
    start = device_clock_ns()
    poll = start + ABORT_POLL_NS
    while (tl.sum((sent < n).to(tl.int32), 0) > 0) & (status == 0):
        full = (sent < n) & (sent - consumed >= ring_rows)
        if tl.sum(full.to(tl.int32), 0) > 0:  # credits back from the sources whose rings are full
            _, back = head_state(tl.atomic_add(heads, 0, mask=full, sem="acquire", scope="sys"), seq64)
            consumed = tl.where(full, tl.maximum(consumed, back), consumed)
            tl.debug_barrier()  # every thread writes the freed slots after the acquire
        moved = tl.zeros([], dtype=tl.int32)
        for s in tl.static_range(NUM_RANKS):  # round-robin: a source slow to give credits holds up no other
            done = pick(sent, r, s)
            m = tl.minimum(tl.minimum(pick(n, r, s) - done, ring_rows - (done - pick(consumed, r, s))), PUBLISH)
            if m > 0:
                rows = i < m
                src = pick(lo, r, s) + done + i
                dst = space_of(bases_ptr, s) + rings + ((done + i) % ring_rows) * row_words
                for k in tl.static_range(X_CHUNKS):
                    cols = k * X_BLOCK + tl.arange(0, X_BLOCK)
                    both = rows[:, None] & (cols < x_words)[None, :]
                    tl.store(dst[:, None] + cols[None, :],
                             tl.load(x_ptr + src[:, None] * x_words + cols[None, :], mask=both), mask=both)
                if HAS_W:  # the weights as float32 after x: floats 2 * x_words + j
                    kin = rows[:, None] & (kc < num_k)[None, :]
                    tl.store(dst.to(tl.pointer_type(tl.float32))[:, None] + 2 * x_words + kc[None, :],
                             tl.load(w_ptr + src[:, None] * num_k + kc[None, :], mask=kin), mask=kin)
                publish_one(space_of(bases_ptr, s) + (me * CHANNELS + c) * COUNTER, seq64, done + m, 0)
                sent = tl.where(r == s, done + m, sent)
                moved += 1
        if moved > 0:
            start = device_clock_ns()
            poll = start + ABORT_POLL_NS
        else:  # every source with rows left has a full ring (its tail published with the rows)
            full = (sent < n) & (sent - consumed >= ring_rows)
            status, poll = ended(start, poll, timeout_ns, abort_ptr, seq64, W_CREDIT, first(full, r), moved == 0)
    # 3. FIN to every source, also where this channel sent it nothing
    if status == 0:
        publish(tails, seq64, sent, FIN, rm, R_BLOCK)
    return status


@triton.jit
def combine_recv(rows_ptr, bases_ptr, out_ptr, out_w_ptr, abort_ptr, c, me, seq64, num_tokens, x_words, num_k,
                 row_words, ring_rows, timeout_ns,
                 NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr, H_BLOCK: tl.constexpr,
                 H_CHUNKS: tl.constexpr, PER_WORD: tl.constexpr, K_BLOCK: tl.constexpr, HAS_W: tl.constexpr,
                 BATCH: tl.constexpr):
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    own = space_of(bases_ptr, me)
    tails = own + (r * CHANNELS + c) * COUNTER
    heads = tl.load(bases_ptr + r, mask=rm, other=0).to(tl.pointer_type(tl.int64)) + \
        NUM_RANKS * CHANNELS * COUNTER + (me * CHANNELS + c) * COUNTER
    hidden = x_words * PER_WORD
    elem = out_ptr.dtype.element_ty
    consumed = tl.zeros([R_BLOCK], dtype=tl.int64)
    counts = tl.zeros([R_BLOCK], dtype=tl.int64)  # the rows each rank's tail counted, this call
    status = tl.zeros([], dtype=tl.int64)
    # tokens [c * ceil(T/C), ...) in order, ``step`` a tile: at most a ring of rows from any rank
    per = tl.cdiv(num_tokens, CHANNELS)
    t = (c * per).to(tl.int64)
    end = tl.minimum(num_tokens, (c + 1) * per).to(tl.int64)
    step = tl.minimum(ring_rows, BATCH)
    i = tl.arange(0, BATCH)
    kc = tl.arange(0, K_BLOCK)
    while (t < end) & (status == 0):
        tok = t + i
        tm = (i < step) & (tok < end)
        goes = tl.load(rows_ptr + tok[:, None] * NUM_RANKS + r[None, :], mask=tm[:, None] & rm[None, :], other=-1) >= 0
        need = tl.sum(goes.to(tl.int64), 0)
        # 1. every rank's rows of the tile are in its ring (a bounded wait)
        short = need > counts - consumed
        start = device_clock_ns()
        poll = start + ABORT_POLL_NS
        while (tl.sum(short.to(tl.int32), 0) > 0) & (status == 0):
            tail = tl.atomic_add(tails, 0, mask=short, sem="acquire", scope="sys")
            ours = short & ((tail >> 32) == seq64)
            counts = tl.where(ours, tail & COUNT_MASK, counts)
            short = need > counts - consumed
            over = short & ours & (((tail >> 31) & 1) != 0)  # FIN, and fewer rows than the tokens need
            if tl.sum(over.to(tl.int32), 0) > 0:
                status = tl.zeros([], dtype=tl.int64) + ((BAD_ROW << 16) | first(over, r))
            else:
                status, poll = ended(start, poll, timeout_ns, abort_ptr, seq64, W_ROWS, first(short, r),
                                     tl.sum(short.to(tl.int32), 0) > 0)
        if status == 0:
            tl.debug_barrier()  # every thread reads the rows after the acquire
            # 2. token i's copy from rank d is d's row consumed[d] + (copies to d before i in the tile)
            # (a masked sum over the tile, not tl.cumsum: Triton 3.6 fails to lower this scan for sm90)
            g = goes.to(tl.int32)
            before = tl.sum(tl.where(i[None, :, None] < i[:, None, None], g[None, :, :], 0), 1)
            at = consumed[None, :] + before.to(tl.int64)
            slot = at % ring_rows
            for k in tl.static_range(H_CHUNKS):
                cols = k * H_BLOCK + tl.arange(0, H_BLOCK)
                acc = tl.zeros([BATCH, H_BLOCK], dtype=tl.float32)
                for d in tl.static_range(NUM_RANKS):  # rank order: the sum is the same bits every run
                    g = tl.sum(tl.where(r[None, :] == d, goes.to(tl.int32), 0), 1) > 0
                    ring = ring_of(own, d, c, ring_rows, row_words, NUM_RANKS, CHANNELS).to(tl.pointer_type(elem))
                    row = ring + tl.sum(tl.where(r[None, :] == d, slot, 0), 1) * (row_words * PER_WORD)
                    v = tl.load(row[:, None] + cols[None, :], mask=g[:, None] & (cols < hidden)[None, :], other=0.0,
                                cache_modifier=".cg")
                    acc += v.to(tl.float32)
                tl.store(out_ptr + tok[:, None] * hidden + cols[None, :], acc.to(elem),
                         mask=tm[:, None] & (cols < hidden)[None, :])
            if HAS_W:
                wsum = tl.zeros([BATCH, K_BLOCK], dtype=tl.float32)
                for d in tl.static_range(NUM_RANKS):
                    g = tl.sum(tl.where(r[None, :] == d, goes.to(tl.int32), 0), 1) > 0
                    ring = ring_of(own, d, c, ring_rows, row_words, NUM_RANKS, CHANNELS).to(tl.pointer_type(tl.float32))
                    row = ring + tl.sum(tl.where(r[None, :] == d, slot, 0), 1) * (2 * row_words)
                    wsum += tl.load(row[:, None] + 2 * x_words + kc[None, :],
                                    mask=g[:, None] & (kc < num_k)[None, :], other=0.0, cache_modifier=".cg")
                tl.store(out_w_ptr + tok[:, None] * num_k + kc[None, :], wsum,
                         mask=tm[:, None] & (kc < num_k)[None, :])
            # 3. credits back to every rank whose rows the tile took (their slots are free again)
            consumed += need
            publish(heads, seq64, consumed, 0, need > 0, R_BLOCK)
            t += step
    # 4. every rank's FIN with no row left over: its ring and tail are read for this call
    waiting = rm
    start = device_clock_ns()
    poll = start + ABORT_POLL_NS
    while (tl.sum(waiting.to(tl.int32), 0) > 0) & (status == 0):
        tail = tl.atomic_add(tails, 0, mask=waiting, sem="acquire", scope="sys")
        ours = waiting & ((tail >> 32) == seq64)
        fin = ours & (((tail >> 31) & 1) != 0)
        extra = ours & ((tail & COUNT_MASK) > consumed)
        waiting = waiting & ~(fin & ~extra)
        if tl.sum(extra.to(tl.int32), 0) > 0:  # more rows than this rank's tokens sent there
            status = tl.zeros([], dtype=tl.int64) + ((BAD_ROW << 16) | first(extra, r))
        else:
            status, poll = ended(start, poll, timeout_ns, abort_ptr, seq64, W_ROWS, first(waiting, r),
                                 tl.sum(waiting.to(tl.int32), 0) > 0)
    if status == 0:
        publish(heads, seq64, consumed, FIN, rm, R_BLOCK)
    return status
