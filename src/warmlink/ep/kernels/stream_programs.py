"""The Triton kernel of the streamed dispatch (ep.kernels.stream launches it; Note [Streamed dispatch] there).

Imported only where Triton is. Its helpers (``device_clock_ns``, ``fence_system``, ``meta_parts``)
are names of this module, so that tests swap the clock and the fence here for the interpreter.
"""

import triton
import triton.language as tl

from warmlink.ep.kernels.programs import device_clock_ns, fence_system, meta_parts

# The space's words (ep.kernels.stream.StreamSpace): tails, then heads, then rings; a counter has a
# 128-byte line of its own, so that a poll never shares a line with another pair's writes
COUNTER = tl.constexpr(16)
FIN = tl.constexpr(1 << 31)  # in a tail: the channel sent its last row; in a head: it took it
COUNT_MASK = tl.constexpr((1 << 31) - 1)
# A program's status word: seq << 32 | ABORTED | wait << 16 | peer (ep.kernels.stream.Failure)
W_PREVIOUS = tl.constexpr(1)  # a sender: the peer has not taken the previous call's rows
W_CREDIT = tl.constexpr(2)  # a sender: the peer's ring stayed full
W_ROWS = tl.constexpr(3)  # a receiver: the peer sent no row
BAD_ROW = tl.constexpr(4)  # a receiver: a row's ordinal fell outside its source's output rows
ABORTED = tl.constexpr(1 << 24)  # the wait ended by the abort word, not by the deadline
_BIG = tl.constexpr(1 << 30)
ALL_THREADS = tl.constexpr(1024)  # a block at least as wide as a program's threads


@triton.jit(do_not_specialize=["seq", "num_tokens", "out_rows", "first_program"])
def stream_dispatch_kernel(rows_ptr, x_ptr, topk_ptr, w_ptr, s_ptr, bases_ptr, offsets_ptr, out_x_ptr, out_idx_ptr,
                           out_w_ptr, out_s_ptr, status_ptr, abort_ptr, me, seq, num_tokens, max_tokens, x_words, num_k,
                           num_scales, s_token_stride, s_col_stride, meta_words, row_words, ring_rows, out_rows,
                           experts_per_rank, timeout_ns, first_program, taken_ptr,
                           NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr,
                           X_BLOCK: tl.constexpr, CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                           HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr, PUBLISH: tl.constexpr,
                           BATCH: tl.constexpr):
    # program p < CHANNELS sends channel p's tokens, program CHANNELS + c receives channel c;
    # ``first_program`` lets a launch run only one role (the interpreter runs programs in order)
    p = tl.program_id(0) + first_program
    seq64 = seq.to(tl.int64)
    if p < CHANNELS:
        status = send_steps(rows_ptr, x_ptr, topk_ptr, w_ptr, s_ptr, bases_ptr, abort_ptr, p, me, seq64, num_tokens,
                            max_tokens, x_words, num_k, num_scales, s_token_stride, s_col_stride, meta_words,
                            row_words, ring_rows, timeout_ns, NUM_RANKS, CHANNELS, R_BLOCK, X_BLOCK, CHUNKS, K_BLOCK,
                            S_BLOCK, HAS_TOPK, HAS_W, HAS_S, PUBLISH)
    else:
        status = recv_steps(bases_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, out_s_ptr, abort_ptr,
                            p - CHANNELS, me, seq64, x_words, num_k, num_scales, meta_words, row_words, ring_rows,
                            out_rows, experts_per_rank, timeout_ns, NUM_RANKS, CHANNELS, R_BLOCK, X_BLOCK, CHUNKS,
                            K_BLOCK, S_BLOCK, HAS_TOPK, HAS_W, HAS_S, BATCH, taken_ptr)
    tl.store(status_ptr + p, (seq64 << 32) | status)


@triton.jit
def space_of(bases_ptr, rank):
    # rank's stream space, as mapped in this process
    return tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int64))


@triton.jit
def head_state(h, seq64):
    # (whether the ring may take this call's rows, how many of them the peer took): a head of
    # this call, or of the previous one with FIN (all its rows taken), or the zero word before a
    # first call; anything else means the previous call's rows may still be read
    hseq = h >> 32
    fin = ((h >> 31) & 1) != 0
    ready = (hseq == seq64) | ((hseq == seq64 - 1) & (fin | (hseq == 0)))
    return ready, tl.where(hseq == seq64, h & COUNT_MASK, 0)


@triton.jit
def ended(start, timeout_ns, abort_ptr, seq64, wait, peer, going):
    # the status of a wait still ``going``: 0, or its code once past the deadline or aborted. Each
    # thread reads the clock and the abort word itself, and warps at different times: the code is
    # reduced over a block that spans every thread, so that all of them leave a wait together
    stop = tl.load(abort_ptr.to(tl.pointer_type(tl.int64)), volatile=True) == seq64
    late = (device_clock_ns() - start) > timeout_ns
    code = tl.where(stop, ABORTED, 0).to(tl.int64) | (wait << 16) | peer.to(tl.int64)
    mine = tl.where(going & (late | stop), code, 0)
    return tl.max(tl.where(tl.arange(0, ALL_THREADS) >= 0, mine, 0), 0)


@triton.jit
def first(mask, r):
    # the lowest rank where ``mask`` holds (_BIG: none)
    return tl.min(tl.where(mask, r, _BIG), 0)


@triton.jit
def publish(ptrs, seq64, counts, flag, mask):
    # every thread's row stores reach the system before the word that counts them
    fence_system()
    tl.debug_barrier()
    tl.atomic_xchg(ptrs, (seq64 << 32) | flag | counts, mask=mask, sem="release", scope="sys")


@triton.jit
def send_steps(rows_ptr, x_ptr, topk_ptr, w_ptr, s_ptr, bases_ptr, abort_ptr, c, me, seq64, num_tokens, max_tokens,
               x_words, num_k, num_scales, s_token_stride, s_col_stride, meta_words, row_words, ring_rows, timeout_ns,
               NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr, X_BLOCK: tl.constexpr,
               CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr,
               HAS_W: tl.constexpr, HAS_S: tl.constexpr, PUBLISH: tl.constexpr):
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    heads = space_of(bases_ptr, me) + NUM_RANKS * CHANNELS * COUNTER + (r * CHANNELS + c) * COUNTER
    tails = tl.load(bases_ptr + r, mask=rm, other=0).to(tl.pointer_type(tl.int64)) + (me * CHANNELS + c) * COUNTER
    rings = 2 * NUM_RANKS * CHANNELS * COUNTER + ((me * CHANNELS + c) * ring_rows).to(tl.int64) * row_words
    status = tl.zeros([], dtype=tl.int64)
    # 1. every destination took the previous call's rows of this channel: its ring and tail are free
    consumed = tl.zeros([R_BLOCK], dtype=tl.int64)
    waiting = rm
    start = device_clock_ns()
    while (tl.sum(waiting.to(tl.int32), 0) > 0) & (status == 0):
        ready, took = head_state(tl.atomic_add(heads, 0, mask=waiting, sem="acquire", scope="sys"), seq64)
        consumed = tl.where(waiting, took, consumed)
        waiting = waiting & ~ready
        status = ended(start, timeout_ns, abort_ptr, seq64, W_PREVIOUS, first(waiting, r),
                       tl.sum(waiting.to(tl.int32), 0) > 0)
    # 2. the tokens of this channel, in order, into each destination's ring
    per = tl.cdiv(num_tokens, CHANNELS)
    t = (c * per).to(tl.int64)
    end = tl.minimum(num_tokens, (c + 1) * per).to(tl.int64)
    counts = tl.zeros([R_BLOCK], dtype=tl.int64)
    published = tl.zeros([R_BLOCK], dtype=tl.int64)
    kc = tl.arange(0, K_BLOCK)
    sc = tl.arange(0, S_BLOCK)
    while (t < end) & (status == 0):
        goes = tl.load(rows_ptr + t * NUM_RANKS + r, mask=rm, other=-1) >= 0
        full = goes & (counts - consumed >= ring_rows)
        if tl.sum(full.to(tl.int32), 0) > 0:  # a credit wait: the rows it waits on must be visible first
            due = full & (counts > published)
            publish(tails, seq64, counts, 0, due)
            published = tl.where(due, counts, published)
            start = device_clock_ns()
            while (tl.sum(full.to(tl.int32), 0) > 0) & (status == 0):
                _, took = head_state(tl.atomic_add(heads, 0, mask=full, sem="acquire", scope="sys"), seq64)
                consumed = tl.where(full, tl.maximum(consumed, took), consumed)
                full = goes & (counts - consumed >= ring_rows)
                status = ended(start, timeout_ns, abort_ptr, seq64, W_CREDIT, first(full, r),
                               tl.sum(full.to(tl.int32), 0) > 0)
        if status == 0:
            for k in tl.static_range(CHUNKS):
                cols = k * X_BLOCK + tl.arange(0, X_BLOCK)
                in_row = cols < x_words
                row = tl.load(x_ptr + t * x_words + cols, mask=in_row)
                for d in tl.static_range(NUM_RANKS):
                    if tl.load(rows_ptr + t * NUM_RANKS + d) >= 0:
                        slot = tl.sum(tl.where(r == d, counts, 0), 0) % ring_rows
                        tl.store(space_of(bases_ptr, d) + rings + slot * row_words + cols, row, mask=in_row)
            ids, ws, ss = meta_parts(topk_ptr, w_ptr, s_ptr, t, num_k, num_scales, s_token_stride, s_col_stride, kc, sc,
                                     HAS_TOPK, HAS_W, HAS_S)
            for d in tl.static_range(NUM_RANKS):
                at = tl.load(rows_ptr + t * NUM_RANKS + d)
                if at >= 0:
                    slot = tl.sum(tl.where(r == d, counts, 0), 0) % ring_rows
                    meta = space_of(bases_ptr, d) + rings + slot * row_words + x_words
                    if HAS_TOPK:
                        tl.store(meta + kc, ids, mask=kc < num_k)
                    if HAS_W:
                        tl.store(meta.to(tl.pointer_type(tl.float32)) + 2 * num_k + kc, ws, mask=kc < num_k)
                    if HAS_S:
                        tl.store(meta.to(tl.pointer_type(tl.float32)) + 3 * num_k + sc, ss, mask=sc < num_scales)
                    tl.store(meta + meta_words, at - d * max_tokens)  # its ordinal at d
            counts += goes.to(tl.int64)
            due = goes & (counts - published >= PUBLISH)
            if tl.sum(due.to(tl.int32), 0) > 0:
                publish(tails, seq64, counts, 0, due)
                published = tl.where(due, counts, published)
            t += 1
    # 3. FIN to every destination, also where this channel sent it nothing
    if status == 0:
        publish(tails, seq64, counts, FIN, rm)
    return status


@triton.jit
def recv_steps(bases_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, out_s_ptr, abort_ptr, c, me, seq64,
               x_words, num_k, num_scales, meta_words, row_words, ring_rows, out_rows, experts_per_rank, timeout_ns,
               NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr, X_BLOCK: tl.constexpr,
               CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr,
               HAS_W: tl.constexpr, HAS_S: tl.constexpr, BATCH: tl.constexpr, taken_ptr):
    r = tl.arange(0, R_BLOCK)
    own = space_of(bases_ptr, me)
    kc = tl.arange(0, K_BLOCK)
    sc = tl.arange(0, S_BLOCK)
    base = me * experts_per_rank
    consumed = tl.zeros([R_BLOCK], dtype=tl.int64)
    left = (r < NUM_RANKS).to(tl.int32)  # sources whose FIN and rows this channel has not all taken
    heard = tl.zeros([R_BLOCK], dtype=tl.int32)  # sources with a tail of this call
    status = tl.zeros([], dtype=tl.int64)
    bad = tl.zeros([], dtype=tl.int64)
    start = device_clock_ns()
    while (tl.sum(left, 0) > 0) & (status == 0):
        moved = tl.zeros([], dtype=tl.int32)
        for s in tl.static_range(NUM_RANKS):  # round-robin: a slow source holds up no other
            if tl.sum(tl.where(r == s, left, 0), 0) > 0:
                tail = tl.atomic_add(own + (s * CHANNELS + c) * COUNTER, 0, sem="acquire", scope="sys")
                ours = (tail >> 32) == seq64
                heard = tl.where(r == s, ours.to(tl.int32), heard)
                count = tl.where(ours, tail & COUNT_MASK, 0)
                have = tl.sum(tl.where(r == s, consumed, 0), 0)
                n = tl.maximum(tl.minimum(count - have, BATCH), 0)
                if n > 0:
                    tl.debug_barrier()  # every thread reads the rows after the acquire
                    bad = take_rows(own, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, out_s_ptr, s, c, have, n, bad,
                                    base, x_words, num_k, num_scales, meta_words, row_words, ring_rows, out_rows,
                                    experts_per_rank, NUM_RANKS, CHANNELS, X_BLOCK, CHUNKS, K_BLOCK, S_BLOCK,
                                    HAS_TOPK, HAS_W, HAS_S, kc, sc)
                have += n
                finished = ours & (((tail >> 31) & 1) != 0) & (have == count)
                if (n > 0) | finished:  # credits back to the source (its ring slots are free again)
                    there = space_of(bases_ptr, s) + NUM_RANKS * CHANNELS * COUNTER + (me * CHANNELS + c) * COUNTER
                    publish(there, seq64, have, tl.where(finished, FIN, 0).to(tl.int64), None)
                    moved += 1
                consumed = tl.where(r == s, have, consumed)
                left = tl.where((r == s) & finished, 0, left)
        if moved > 0:
            start = device_clock_ns()
        else:
            # the peer named: the first source not heard from this call, else the first not done
            silent = first((left > 0) & (heard == 0), r)
            status = ended(start, timeout_ns, abort_ptr, seq64, W_ROWS,
                           tl.where(silent < _BIG, silent, first(left > 0, r)), moved == 0)
    # the rows this channel took from each source: where the streamed combine (ep.kernels.stream_combine)
    # finds the rows it sends each source back on this channel
    tl.store(taken_ptr + r * CHANNELS + c, consumed, mask=r < NUM_RANKS)
    return tl.where(status != 0, status, bad)


@triton.jit
def take_rows(own, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, out_s_ptr, s, c, have, n, bad, base, x_words, num_k,
              num_scales, meta_words, row_words, ring_rows, out_rows, experts_per_rank,
              NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, X_BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
              K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr,
              HAS_S: tl.constexpr, kc, sc):
    # rows [have, have + n) of source s's ring of channel c into the outputs, at the rows of
    # source s (offsets[s] on, below offsets[s + 1]) given by their ordinals; ring loads bypass L1
    # (.cg): a slot holds another row on the next lap
    ring = own + 2 * NUM_RANKS * CHANNELS * COUNTER + ((s * CHANNELS + c) * ring_rows).to(tl.int64) * row_words
    lo = tl.load(offsets_ptr + s)
    hi = tl.load(offsets_ptr + s + 1, mask=s + 1 < NUM_RANKS, other=out_rows)
    for i in range(have, have + n):
        row = ring + (i % ring_rows) * row_words
        meta = row + x_words
        ordinal = tl.load(meta + meta_words, cache_modifier=".cg")
        o = lo + ordinal
        if (ordinal >= 0) & (o < hi):
            for k in tl.static_range(CHUNKS):
                cols = k * X_BLOCK + tl.arange(0, X_BLOCK)
                in_row = cols < x_words
                tl.store(out_x_ptr + o * x_words + cols, tl.load(row + cols, mask=in_row, cache_modifier=".cg"),
                         mask=in_row)
            if HAS_TOPK:
                raw = tl.load(meta + kc, mask=kc < num_k, other=-1, cache_modifier=".cg")
                local = raw - base
                here = (raw >= 0) & (local >= 0) & (local < experts_per_rank)
                tl.store(out_idx_ptr + o * num_k + kc, tl.where(here, local, -1), mask=kc < num_k)
                if HAS_W:
                    w = tl.load(meta.to(tl.pointer_type(tl.float32)) + 2 * num_k + kc, mask=kc < num_k, other=0.0,
                                cache_modifier=".cg")
                    tl.store(out_w_ptr + o * num_k + kc, tl.where(here, w, 0.0), mask=kc < num_k)
            if HAS_S:
                sv = tl.load(meta.to(tl.pointer_type(tl.float32)) + 3 * num_k + sc, mask=sc < num_scales,
                             cache_modifier=".cg")
                tl.store(out_s_ptr + o * num_scales + sc, sv, mask=sc < num_scales)
        else:
            bad = tl.zeros([], dtype=tl.int64) + ((BAD_ROW << 16) | s)
    return bad
