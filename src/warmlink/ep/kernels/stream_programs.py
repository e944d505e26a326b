"""The Triton kernel of the streamed dispatch (ep.kernels.stream launches it; Note [Streamed dispatch] there).

Imported only where Triton is. Its helpers (``device_clock_ns``, ``fence_system``, ``meta_parts``)
are names of this module, so that tests swap the clock and the fence here for the interpreter.
"""

import triton
import triton.language as tl

from warmlink.ep.kernels.programs import (ABORT_POLL_NS, device_clock_ns, fence_by_one, fence_system, meta_parts,
                                         store_by_one)

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


@triton.jit(do_not_specialize=["num_tokens", "out_rows", "first_program"])
def stream_dispatch_kernel(rows_ptr, x_ptr, topk_ptr, w_ptr, s_ptr, bases_ptr, offsets_ptr, out_x_ptr, out_idx_ptr,
                           out_w_ptr, out_s_ptr, status_ptr, abort_ptr, valid_ptr, me, seq_ptr, num_tokens, max_tokens,
                           x_words, num_k,
                           num_scales, s_token_stride, s_col_stride, meta_words, row_words, ring_rows, out_rows,
                           experts_per_rank, timeout_ns, first_program, taken_ptr,
                           NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr,
                           X_BLOCK: tl.constexpr, CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                           HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr, PUBLISH: tl.constexpr,
                           BATCH: tl.constexpr, TOKENS: tl.constexpr):
    # program p < CHANNELS sends channel p's tokens, program CHANNELS + c receives channel c;
    # the call's seq is the int64 at ``seq_ptr``;
    # ``first_program`` lets a launch run only one role (the interpreter runs programs in order)
    p = tl.program_id(0) + first_program
    seq64 = tl.load(seq_ptr)  # a device word: a graph's replays each run the call of their own seq
    if p < CHANNELS:
        # a round the count exchange refused (its word 0) sends no token, only FIN
        num_tokens = tl.where(tl.load(valid_ptr) != 0, num_tokens, 0)
        status = send_steps(rows_ptr, x_ptr, topk_ptr, w_ptr, s_ptr, bases_ptr, abort_ptr, p, me, seq64, num_tokens,
                            max_tokens, x_words, num_k, num_scales, s_token_stride, s_col_stride, meta_words,
                            row_words, ring_rows, timeout_ns, NUM_RANKS, CHANNELS, R_BLOCK, X_BLOCK, CHUNKS, K_BLOCK,
                            S_BLOCK, HAS_TOPK, HAS_W, HAS_S, PUBLISH, TOKENS)
    else:
        status = recv_steps(bases_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, out_s_ptr, abort_ptr,
                            p - CHANNELS, me, seq64, x_words, num_k, num_scales, meta_words, row_words, ring_rows,
                            out_rows, experts_per_rank, timeout_ns, NUM_RANKS, CHANNELS, R_BLOCK, X_BLOCK, CHUNKS,
                            K_BLOCK, S_BLOCK, HAS_TOPK, HAS_W, HAS_S, BATCH, TOKENS, taken_ptr)
    tl.store(status_ptr + p, (seq64 << 32) | status)


@triton.jit
def space_of(bases_ptr, rank):
    # rank's stream space, as mapped in this process: an allocation's start, 16-byte aligned at least,
    # so that rows of a multiple of 16 words (ep.kernels.stream.row_words) move in 16-byte accesses
    return tl.multiple_of(tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int64)), 16)


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
def ended(start, poll, timeout_ns, abort_ptr, seq64, wait, peer, going):
    # ``(status, poll)`` of a wait still ``going``: 0, or its code once past the deadline or
    # aborted; ``poll`` when it next reads the abort word. Each thread reads the clock and the abort
    # word itself, and warps at different times: the code is reduced over a block that spans every
    # thread, so that all of them leave a wait together. The abort word may lie in pinned host
    # memory, a PCIe round trip away: a wait reads it once every ABORT_POLL_NS (read at every step,
    # it made a call 6x slower on one H200, and slow polls lengthen the peer's waits in turn)
    now = device_clock_ns()
    aborted = tl.zeros([], dtype=tl.int64)
    due = going & (now >= poll)
    if due:
        aborted = tl.load(abort_ptr.to(tl.pointer_type(tl.int64)), volatile=True)
    poll = tl.where(due, now + ABORT_POLL_NS, poll)
    stop = aborted >= seq64
    late = now - start > timeout_ns
    code = tl.where(stop, ABORTED, 0).to(tl.int64) | (wait << 16) | peer.to(tl.int64)
    mine = tl.where(going & (late | stop), code, 0)
    return tl.max(tl.where(tl.arange(0, ALL_THREADS) >= 0, mine, 0), 0), poll


@triton.jit
def first(mask, r):
    # the lowest rank where ``mask`` holds (_BIG: none)
    return tl.min(tl.where(mask, r, _BIG), 0)


@triton.jit
def publish(ptrs, seq64, counts, flag, mask, R_BLOCK: tl.constexpr):
    # ``seq << 32 | flag | counts`` into each word of ``ptrs`` where ``mask`` holds ([R_BLOCK]
    # vectors), after every thread's row stores: one barrier, one system fence (thread 0's) and
    # thread 0's stores, none of which waits for an answer across NVLink (a fence in every thread,
    # or an exchange per word, would hold the whole program that long at each publish)
    tl.debug_barrier()
    fence_by_one()
    r = tl.arange(0, R_BLOCK)
    words = (seq64 << 32) | flag | counts
    addrs = ptrs.to(tl.int64)
    for d in tl.static_range(R_BLOCK):
        if tl.sum(((r == d) & mask).to(tl.int32), 0) > 0:
            store_by_one(tl.sum(tl.where(r == d, addrs, 0), 0), tl.sum(tl.where(r == d, words, 0), 0))


@triton.jit
def publish_one(ptr, seq64, count, flag):
    # ``publish`` of one word (scalars)
    tl.debug_barrier()
    fence_by_one()
    store_by_one(ptr.to(tl.int64), (seq64 << 32) | flag | count)


@triton.jit
def column(m, r, d):
    # column d of a [TOKENS, R_BLOCK] block, as a [TOKENS] vector (one reduction a tile, not a row)
    return tl.sum(tl.where(r[None, :] == d, m, 0), 1)


@triton.jit
def previous_taken(heads, rm, r, seq64, timeout_ns, abort_ptr, R_BLOCK: tl.constexpr):
    # a sender's first wait, the dispatch's and the combine's: every peer's head of this channel says
    # it took the previous call's rows (``head_state``); ``(credits of this call, status)``
    status = tl.zeros([], dtype=tl.int64)
    consumed = tl.zeros([R_BLOCK], dtype=tl.int64)
    waiting = rm
    start = device_clock_ns()
    poll = start + ABORT_POLL_NS
    while (tl.sum(waiting.to(tl.int32), 0) > 0) & (status == 0):
        ready, took = head_state(tl.atomic_add(heads, 0, mask=waiting, sem="acquire", scope="sys"), seq64)
        consumed = tl.where(waiting, took, consumed)
        waiting = waiting & ~ready
        status, poll = ended(start, poll, timeout_ns, abort_ptr, seq64, W_PREVIOUS, first(waiting, r),
                             tl.sum(waiting.to(tl.int32), 0) > 0)
    return consumed, status


@triton.jit
def send_steps(rows_ptr, x_ptr, topk_ptr, w_ptr, s_ptr, bases_ptr, abort_ptr, c, me, seq64, num_tokens, max_tokens,
               x_words, num_k, num_scales, s_token_stride, s_col_stride, meta_words, row_words, ring_rows, timeout_ns,
               NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr, X_BLOCK: tl.constexpr,
               CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr,
               HAS_W: tl.constexpr, HAS_S: tl.constexpr, PUBLISH: tl.constexpr, TOKENS: tl.constexpr):
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    heads = space_of(bases_ptr, me) + NUM_RANKS * CHANNELS * COUNTER + (r * CHANNELS + c) * COUNTER
    tails = tl.load(bases_ptr + r, mask=rm, other=0).to(tl.pointer_type(tl.int64)) + (me * CHANNELS + c) * COUNTER
    rings = 2 * NUM_RANKS * CHANNELS * COUNTER + ((me * CHANNELS + c) * ring_rows).to(tl.int64) * row_words
    # 1. every destination took the previous call's rows of this channel: its ring and tail are free
    consumed, status = previous_taken(heads, rm, r, seq64, timeout_ns, abort_ptr, R_BLOCK)
    # 2. the tokens of this channel, in order, a tile of TOKENS at a time, into each destination's ring
    per = tl.cdiv(num_tokens, CHANNELS)
    t = (c * per).to(tl.int64)
    end = tl.minimum(num_tokens, (c + 1) * per).to(tl.int64)
    counts = tl.zeros([R_BLOCK], dtype=tl.int64)
    published = tl.zeros([R_BLOCK], dtype=tl.int64)
    tok = tl.arange(0, TOKENS)
    kc = tl.arange(0, K_BLOCK)
    sc = tl.arange(0, S_BLOCK)
    while (t < end) & (status == 0):
        ts = t + tok
        valid = ts < end
        at = tl.load(rows_ptr + ts[:, None] * NUM_RANKS + r[None, :], mask=valid[:, None] & rm[None, :], other=-1)
        goes = at >= 0  # [TOKENS, R_BLOCK]
        within = tl.cumsum(goes.to(tl.int64), 0)  # the token's row to d is the tile's within-th to d
        room = ring_rows - (counts - consumed)
        short = tl.sum(goes.to(tl.int64), 0) > room
        if tl.sum(short.to(tl.int32), 0) > 0:  # credits for the whole tile, if the heads have them now
            _, took = head_state(tl.atomic_add(heads, 0, mask=short, sem="acquire", scope="sys"), seq64)
            consumed = tl.where(short, tl.maximum(consumed, took), consumed)
            room = ring_rows - (counts - consumed)
        # the tile's tokens up to the first whose row finds no slot (a ring smaller than a tile too)
        over = tl.max((goes & (within > room[None, :])).to(tl.int32), 1) > 0
        take = tl.min(tl.where(over | ~valid, tok, TOKENS), 0)
        if take == 0:  # a credit wait for token t: the rows it waits on must be visible first
            full = (tl.sum(tl.where(tok[:, None] == 0, goes.to(tl.int32), 0), 0) > 0) & (room <= 0)
            due = full & (counts > published)
            publish(tails, seq64, counts, 0, due, R_BLOCK)
            published = tl.where(due, counts, published)
            start = device_clock_ns()
            poll = start + ABORT_POLL_NS
            while (tl.sum(full.to(tl.int32), 0) > 0) & (status == 0):
                _, took = head_state(tl.atomic_add(heads, 0, mask=full, sem="acquire", scope="sys"), seq64)
                consumed = tl.where(full, tl.maximum(consumed, took), consumed)
                full = full & (counts - consumed >= ring_rows)
                status, poll = ended(start, poll, timeout_ns, abort_ptr, seq64, W_CREDIT, first(full, r),
                                     tl.sum(full.to(tl.int32), 0) > 0)
        else:
            inn = tok < take
            mine = (goes & inn[:, None]).to(tl.int32)
            slots = (counts[None, :] + within - 1) % ring_rows
            for k in tl.static_range(CHUNKS):
                cols = k * X_BLOCK + tl.arange(0, X_BLOCK)
                in_row = cols < x_words
                block = tl.load(x_ptr + ts[:, None] * x_words + cols[None, :], mask=inn[:, None] & in_row[None, :])
                for d in tl.static_range(NUM_RANKS):
                    go = column(mine, r, d) > 0
                    if tl.sum(go.to(tl.int32), 0) > 0:
                        slot = column(slots, r, d)
                        tl.store(space_of(bases_ptr, d) + rings + slot[:, None] * row_words + cols[None, :], block,
                                 mask=go[:, None] & in_row[None, :])
            kin = inn[:, None] & (kc[None, :] < num_k)
            sin = inn[:, None] & (sc[None, :] < num_scales)
            if HAS_TOPK:
                ids = tl.load(topk_ptr + ts[:, None] * num_k + kc[None, :], mask=kin).to(tl.int64)
            if HAS_W:
                ws = tl.load(w_ptr + ts[:, None] * num_k + kc[None, :], mask=kin).to(tl.float32)
            if HAS_S:
                ss = tl.load(s_ptr + ts[:, None] * s_token_stride + sc[None, :].to(tl.int64) * s_col_stride, mask=sin)
            for d in tl.static_range(NUM_RANKS):
                go = column(mine, r, d) > 0
                if tl.sum(go.to(tl.int32), 0) > 0:
                    meta = rings + column(slots, r, d) * row_words + x_words  # [TOKENS] words into d's space
                    there = space_of(bases_ptr, d)
                    floats = there.to(tl.pointer_type(tl.float32)) + 2 * meta
                    if HAS_TOPK:
                        tl.store(there + meta[:, None] + kc[None, :], ids, mask=go[:, None] & kin)
                    if HAS_W:
                        tl.store(floats[:, None] + 2 * num_k + kc[None, :], ws, mask=go[:, None] & kin)
                    if HAS_S:
                        tl.store(floats[:, None] + 3 * num_k + sc[None, :], ss, mask=go[:, None] & sin)
                    tl.store(there + meta + meta_words, column(at, r, d) - d * max_tokens, mask=go)  # its ordinal
            counts += tl.sum(mine, 0).to(tl.int64)
            due = rm & (counts - published >= PUBLISH)
            if tl.sum(due.to(tl.int32), 0) > 0:
                publish(tails, seq64, counts, 0, due, R_BLOCK)
                published = tl.where(due, counts, published)
            t += take
    # 3. FIN to every destination, also where this channel sent it nothing
    if status == 0:
        publish(tails, seq64, counts, FIN, rm, R_BLOCK)
    return status


@triton.jit
def recv_steps(bases_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, out_s_ptr, abort_ptr, c, me, seq64,
               x_words, num_k, num_scales, meta_words, row_words, ring_rows, out_rows, experts_per_rank, timeout_ns,
               NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, R_BLOCK: tl.constexpr, X_BLOCK: tl.constexpr,
               CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr,
               HAS_W: tl.constexpr, HAS_S: tl.constexpr, BATCH: tl.constexpr, TOKENS: tl.constexpr, taken_ptr):
    r = tl.arange(0, R_BLOCK)
    own = space_of(bases_ptr, me)
    base = me * experts_per_rank
    consumed = tl.zeros([R_BLOCK], dtype=tl.int64)
    left = (r < NUM_RANKS).to(tl.int32)  # sources whose FIN and rows this channel has not all taken
    heard = tl.zeros([R_BLOCK], dtype=tl.int32)  # sources with a tail of this call
    status = tl.zeros([], dtype=tl.int64)
    bad = tl.zeros([], dtype=tl.int64)
    start = device_clock_ns()
    poll = start + ABORT_POLL_NS
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
                                    HAS_TOPK, HAS_W, HAS_S, TOKENS)
                have += n
                finished = ours & (((tail >> 31) & 1) != 0) & (have == count)
                if (n > 0) | finished:  # credits back to the source (its ring slots are free again)
                    there = space_of(bases_ptr, s) + NUM_RANKS * CHANNELS * COUNTER + (me * CHANNELS + c) * COUNTER
                    publish_one(there, seq64, have, tl.where(finished, FIN, 0).to(tl.int64))
                    moved += 1
                consumed = tl.where(r == s, have, consumed)
                left = tl.where((r == s) & finished, 0, left)
        if moved > 0:
            start = device_clock_ns()
            poll = start + ABORT_POLL_NS
        else:
            # the peer named: the first source not heard from this call, else the first not done
            silent = first((left > 0) & (heard == 0), r)
            status, poll = ended(start, poll, timeout_ns, abort_ptr, seq64, W_ROWS,
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
              HAS_S: tl.constexpr, TOKENS: tl.constexpr):
    # rows [have, have + n) of source s's ring of channel c into the outputs, TOKENS rows a step, at
    # the rows of source s (offsets[s] on, below offsets[s + 1]) given by their ordinals; ring loads
    # bypass L1 (.cg): a slot holds another row on the next lap
    ring = own + 2 * NUM_RANKS * CHANNELS * COUNTER + ((s * CHANNELS + c) * ring_rows).to(tl.int64) * row_words
    lo = tl.load(offsets_ptr + s)
    hi = tl.load(offsets_ptr + s + 1, mask=s + 1 < NUM_RANKS, other=out_rows)
    kc = tl.arange(0, K_BLOCK)
    sc = tl.arange(0, S_BLOCK)
    for j in range(have, have + n, TOKENS):
        i = j + tl.arange(0, TOKENS).to(tl.int64)
        ok = i < have + n
        row = ring + (i % ring_rows) * row_words  # [TOKENS] pointers
        meta = row + x_words
        ordinal = tl.load(meta + meta_words, mask=ok, other=-1, cache_modifier=".cg")
        o = lo + ordinal
        good = ok & (ordinal >= 0) & (o < hi)
        bad = tl.where(tl.sum((ok & ~good).to(tl.int32), 0) > 0, (BAD_ROW << 16) | s, bad).to(tl.int64)
        for k in tl.static_range(CHUNKS):
            cols = k * X_BLOCK + tl.arange(0, X_BLOCK)
            both = good[:, None] & (cols[None, :] < x_words)
            tl.store(out_x_ptr + o[:, None] * x_words + cols[None, :],
                     tl.load(row[:, None] + cols[None, :], mask=both, cache_modifier=".cg"), mask=both)
        kin = good[:, None] & (kc[None, :] < num_k)
        if HAS_TOPK:
            raw = tl.load(meta[:, None] + kc[None, :], mask=kin, other=-1, cache_modifier=".cg")
            local = raw - base
            here = (raw >= 0) & (local >= 0) & (local < experts_per_rank)
            tl.store(out_idx_ptr + o[:, None] * num_k + kc[None, :], tl.where(here, local, -1), mask=kin)
            if HAS_W:
                w = tl.load(meta.to(tl.pointer_type(tl.float32))[:, None] + 2 * num_k + kc[None, :], mask=kin,
                            other=0.0, cache_modifier=".cg")
                tl.store(out_w_ptr + o[:, None] * num_k + kc[None, :], tl.where(here, w, 0.0), mask=kin)
        if HAS_S:
            sin = good[:, None] & (sc[None, :] < num_scales)
            sv = tl.load(meta.to(tl.pointer_type(tl.float32))[:, None] + 3 * num_k + sc[None, :], mask=sin,
                         cache_modifier=".cg")
            tl.store(out_s_ptr + o[:, None] * num_scales + sc[None, :], sv, mask=sin)
    return bad


@triton.jit
def advance_kernel(counters_ptr, call_round_ptr, FRESH: tl.constexpr):
    # the next call's seq (counters[1]); a fresh dispatch's also its count exchange's round
    # (counters[0]), into the round word of its call block
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + 1)
    if FRESH:
        round_ = tl.load(counters_ptr) + 1
        tl.store(counters_ptr, round_)
        tl.store(call_round_ptr, round_)


@triton.jit
def padded_plan_kernel(board_ptr, row, exchange_valid_ptr, offsets_ptr, valid_ptr, me, worst,
                       NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr):
    # from a padded round's board (row s: tag, valid, rows s sends each rank, ...): where each source's
    # rows start at rank ``me`` (the rows of lower sources), and whether the round stands
    s = tl.arange(0, R_BLOCK)
    m = (s[:, None] < NUM_RANKS) & (s[None, :] < NUM_RANKS)
    counts = tl.load(board_ptr + s[:, None] * row + 2 + s[None, :], mask=m, other=0)  # [source, destination]
    fits = tl.max(tl.sum(counts, 0), 0) <= worst
    mine = tl.sum(tl.where(s[None, :] == me, counts, 0), 1)  # [source]: the rows it sends ``me``
    below = tl.sum(tl.where(s[None, :] < s[:, None], mine[None, :], 0), 1)
    tl.store(offsets_ptr + s, below, mask=s < NUM_RANKS)
    tl.store(valid_ptr, ((tl.load(exchange_valid_ptr) != 0) & fits).to(tl.int64))
