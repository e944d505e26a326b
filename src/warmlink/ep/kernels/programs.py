"""The Triton kernels of ep's device steps (ep.kernels.steps holds their entry points and torch twins).

Imported only where Triton is (ep.kernels.steps._build); kept apart so that a kernel can call a
``triton.jit`` helper of this module, which the interpreter resolves through module globals.

Over 400 lines: the kernels and the jit helpers they share stay in one module, because Triton's
interpreter resolves a helper through the calling kernel's module globals, where the tests swap
the PTX ones (the clock, the fences, the barrier) for Python (tests/ep/interpreted_kernels.py).
"""

import triton
import triton.language as tl

from warmlink.ep.kernels.call_block import CALL_SLOTS

# a wait reads its abort word (pinned host memory, a PCIe round trip away) once an interval this long: read at
# every poll it slows the poll, and a slow poll answers a peer late (Wait in ep/kernels/stream.cu)
ABORT_POLL_NS = tl.constexpr(20_000)

# -- the call block (ep.kernels.call_block; ep.paths.sm_pushes, Note [Fresh send graph]) -----------------------
# A fresh SM dispatch's kernels read what changes per call (its tensors' addresses, the token count,
# the round) from a small int64 block in device memory, so that one captured CUDA graph serves every
# call. The word of each, in ep.kernels.call_block.CALL_SLOTS's order:
C_IN_RANK = tl.constexpr(CALL_SLOTS.index("in_rank"))
C_TOPK = tl.constexpr(CALL_SLOTS.index("topk"))
C_PER_RANK = tl.constexpr(CALL_SLOTS.index("per_rank"))
C_PER_EXPERT = tl.constexpr(CALL_SLOTS.index("per_expert"))
C_ROWS = tl.constexpr(CALL_SLOTS.index("rows"))
C_X = tl.constexpr(CALL_SLOTS.index("x"))
C_WEIGHTS = tl.constexpr(CALL_SLOTS.index("weights"))
C_SCALES = tl.constexpr(CALL_SLOTS.index("scales"))
C_SCALES_TOKEN_STRIDE = tl.constexpr(CALL_SLOTS.index("scales_token_stride"))
C_SCALES_COL_STRIDE = tl.constexpr(CALL_SLOTS.index("scales_col_stride"))
C_TOKENS = tl.constexpr(CALL_SLOTS.index("tokens"))
C_ROUND = tl.constexpr(CALL_SLOTS.index("round"))
C_CONFIG = tl.constexpr(CALL_SLOTS.index("config"))
C_BOARD_COPY = tl.constexpr(CALL_SLOTS.index("board_copy"))
CALL_WORDS = tl.constexpr(len(CALL_SLOTS))


@triton.jit
def call_pointer(call_ptr, slot, T: tl.constexpr):
    # the address in word ``slot`` of the call block, as a pointer to T
    return tl.load(call_ptr + slot).to(tl.pointer_type(T))


@triton.jit
def take_call_kernel(host_call, call_ptr, counters_ptr, ADVANCE: tl.constexpr):
    # the call block from pinned host memory (byte address host_call, as the host wrote it before the
    # launch) into its device copy call_ptr, which the later steps read; with ADVANCE the streamed
    # path's counters too (ep.kernels.stream_counts.advance's FRESH steps), the round into the copy
    w = tl.arange(0, 16)
    words = tl.load(host_call.to(tl.pointer_type(tl.int64)) + w, mask=w < CALL_WORDS, other=0, volatile=True)
    if ADVANCE:
        tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + 1)
        round_ = tl.load(counters_ptr) + 1
        tl.store(counters_ptr, round_)
        words = tl.where(w == C_ROUND, round_, words)
    tl.store(call_ptr + w, words, mask=w < CALL_WORDS)


@triton.jit
def plan_kernel(in_rank_ptr, topk_ptr, per_rank_ptr, per_expert_ptr, rows_ptr, words_ptr,
                num_tokens, num_entries, num_experts, max_tokens,
                NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr, BIG: tl.constexpr, PARTS: tl.constexpr):
    plan_steps(in_rank_ptr, topk_ptr, per_rank_ptr, per_expert_ptr, rows_ptr, words_ptr, num_tokens, num_entries,
               num_experts, max_tokens, NUM_RANKS, BLOCK, BIG, PARTS)


@triton.jit
def plan_call_kernel(call_ptr, words_ptr, num_k, num_experts, max_tokens,
                     NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr, BIG: tl.constexpr, PARTS: tl.constexpr,
                     TOPK_T: tl.constexpr, RANK_T: tl.constexpr, EXPERT_T: tl.constexpr):
    num_tokens = tl.load(call_ptr + C_TOKENS).to(tl.int32)  # as the direct kernel's argument
    plan_steps(call_pointer(call_ptr, C_IN_RANK, tl.uint8), call_pointer(call_ptr, C_TOPK, TOPK_T),
               call_pointer(call_ptr, C_PER_RANK, RANK_T), call_pointer(call_ptr, C_PER_EXPERT, EXPERT_T),
               call_pointer(call_ptr, C_ROWS, tl.int64), words_ptr, num_tokens, num_tokens * num_k, num_experts,
               max_tokens, NUM_RANKS, BLOCK, BIG, PARTS)


@triton.jit
def plan_steps(in_rank_ptr, topk_ptr, per_rank_ptr, per_expert_ptr, rows_ptr, words_ptr,
               num_tokens, num_entries, num_experts, max_tokens,
               NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr, BIG: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if pid < NUM_RANKS:  # one program scans one destination's column
        carry = tl.zeros([], dtype=tl.int64)
        for start in range(0, num_tokens, BLOCK):
            t = (start + offs).to(tl.int64)
            m = t < num_tokens
            flag = (tl.load(in_rank_ptr + t * NUM_RANKS + pid, mask=m, other=0) != 0).to(tl.int32)
            incl = tl.cumsum(flag, 0).to(tl.int64)
            row = pid * max_tokens + carry + incl - 1
            tl.store(rows_ptr + t * NUM_RANKS + pid, tl.where(flag != 0, row, -1), mask=m)
            carry += tl.sum(flag, 0).to(tl.int64)
        tl.store(words_ptr + pid, carry)
        tl.store(words_ptr + NUM_RANKS + pid, tl.load(per_rank_ptr + pid).to(tl.int64))
    elif pid == NUM_RANKS:  # the per-expert counts
        for start in range(0, num_experts, BLOCK):
            e = start + offs
            v = tl.load(per_expert_ptr + e, mask=e < num_experts, other=0).to(tl.int64)
            tl.store(words_ptr + 2 * NUM_RANKS + e, v, mask=e < num_experts)
    else:  # the range of the expert ids in one part
        j = pid - NUM_RANKS - 1
        part = tl.cdiv(num_entries, PARTS)
        end = tl.minimum(num_entries, (j + 1) * part)
        lo = tl.full([], BIG, dtype=tl.int64)
        hi = tl.full([], -BIG, dtype=tl.int64)
        for start in range(j * part, end, BLOCK):
            e = (start + offs).to(tl.int64)
            m = e < end
            v = tl.load(topk_ptr + e, mask=m, other=0).to(tl.int64)
            lo = tl.minimum(lo, tl.min(tl.where(m, v, BIG), 0))
            hi = tl.maximum(hi, tl.max(tl.where(m, v, -BIG), 0))
        tl.store(words_ptr + 2 * NUM_RANKS + num_experts + j, lo)
        tl.store(words_ptr + 2 * NUM_RANKS + num_experts + PARTS + j, hi)


@triton.jit
def layout_kernel(topk_ptr, in_rank_ptr, counts_ptr, num_tokens, num_k, num_experts, experts_per_rank,
                  NUM_RANKS: tl.constexpr, T_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, E_BINS: tl.constexpr):
    # counts: [NUM_RANKS] tokens per rank, [num_experts] pairs per expert, [1] bad ids (zeroed).
    # Each program adds its block's histogram: one atomic per expert, not one per (token, expert).
    t = tl.program_id(0) * T_BLOCK + tl.arange(0, T_BLOCK)
    k = tl.arange(0, K_BLOCK)
    tm = t < num_tokens
    m = tm[:, None] & (k[None, :] < num_k)
    idx = tl.load(topk_ptr + t[:, None].to(tl.int64) * num_k + k[None, :], mask=m, other=-1).to(tl.int64)
    valid = m & (idx >= 0) & (idx < num_experts)
    bad = m & ((idx < -1) | (idx >= num_experts))
    tl.atomic_add(counts_ptr + NUM_RANKS + num_experts, tl.sum(tl.sum(bad.to(tl.int32), 1), 0))
    bins = tl.arange(0, E_BINS)
    per_expert = tl.histogram(tl.reshape(tl.where(valid, idx, E_BINS - 1).to(tl.int32), [T_BLOCK * K_BLOCK]), E_BINS)
    tl.atomic_add(counts_ptr + NUM_RANKS + bins, per_expert, mask=(bins < num_experts) & (per_expert > 0))
    rank_of = tl.where(valid, idx // experts_per_rank, -1)
    for r in tl.static_range(NUM_RANKS):
        hit = tl.max((rank_of == r).to(tl.int32), 1)
        tl.store(in_rank_ptr + t.to(tl.int64) * NUM_RANKS + r, hit.to(tl.uint8), mask=tm)
        tl.atomic_add(counts_ptr + r, tl.sum(tl.where(tm, hit, 0), 0))


@triton.jit
def meta_parts(topk_ptr, w_ptr, s_ptr, t, num_k, num_scales, s_token_stride, s_col_stride, kc, sc,
               HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr):
    # token t's meta parts (zeros for the parts it does not have); scale j of token t is at
    # s_ptr + t * s_token_stride + j * s_col_stride: row- or column-major, never copied
    # (ep.kernels.steps, Note [Scales in place])
    ids = tl.zeros(kc.shape, dtype=tl.int64)
    ws = tl.zeros(kc.shape, dtype=tl.float32)
    ss = tl.zeros(sc.shape, dtype=tl.float32)
    if HAS_TOPK:
        ids = tl.load(topk_ptr + t * num_k + kc, mask=kc < num_k).to(tl.int64)
    if HAS_W:
        ws = tl.load(w_ptr + t * num_k + kc, mask=kc < num_k).to(tl.float32)
    if HAS_S:
        ss = tl.load(s_ptr + t * s_token_stride + sc.to(tl.int64) * s_col_stride, mask=sc < num_scales)
    return ids, ws, ss


@triton.jit
def gather_kernel(rows_ptr, x_ptr, x_out_ptr, x_words, topk_ptr, w_ptr, s_ptr, ids_out_ptr, floats_out_ptr,
                  num_k, num_scales, s_token_stride, s_col_stride, meta_words, meta_k, shift, d_lo, d_hi, skip,
                  NUM_RANKS: tl.constexpr, X_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                  HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * X_BLOCK + tl.arange(0, X_BLOCK)
    in_row = cols < x_words
    row = tl.load(x_ptr + t * x_words + cols, mask=in_row)
    kc = tl.arange(0, K_BLOCK)
    sc = tl.arange(0, S_BLOCK)
    ids, ws, ss = meta_parts(topk_ptr, w_ptr, s_ptr, t, num_k, num_scales, s_token_stride, s_col_stride, kc, sc,
                             HAS_TOPK, HAS_W, HAS_S)
    for d in tl.static_range(NUM_RANKS):
        if (d >= d_lo) & (d < d_hi) & (d != skip):
            at = tl.load(rows_ptr + t * NUM_RANKS + d)
            if at >= 0:
                at += shift
                tl.store(x_out_ptr + at * x_words + cols, row, mask=in_row)
                if chunk == 0:  # the first chunk's program also moves the meta row
                    if HAS_TOPK:
                        tl.store(ids_out_ptr + at * meta_words + kc, ids, mask=kc < num_k)
                    if HAS_W:
                        tl.store(floats_out_ptr + at * 2 * meta_words + 2 * meta_k + kc, ws, mask=kc < num_k)
                    if HAS_S:
                        tl.store(floats_out_ptr + at * 2 * meta_words + 3 * meta_k + sc, ss, mask=sc < num_scales)


@triton.jit(do_not_specialize=["round_"])  # one kernel for every round, never a compile mid-run
def unpack_kernel(ids_ptr, floats_ptr, idx_ptr, w_ptr, s_ptr, total, num_k, num_scales, meta_words, meta_k,
                  base, experts_per_rank, board_ptr, round_, me, num_ranks, board_row,
                  ROWS: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                  HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr,
                  PADDED: tl.constexpr, R_BLOCK: tl.constexpr):
    # PADDED: ``total`` rows are padded outputs, and the rows received come from the round's count
    # board (ep.protocol.normal, Note [Padded dispatch returns at launch]): none when a source's tag is
    # not the round's or its input was refused, or a rank receives more than ``total``
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    received = total
    if PADDED:
        d = tl.arange(0, R_BLOCK)
        totals = tl.zeros([R_BLOCK], dtype=tl.int64)
        bad = tl.zeros([], dtype=tl.int32)
        for source in range(num_ranks):
            row = board_ptr + source * board_row
            bad += ((tl.load(row) != round_) | (tl.load(row + 1) == 0)).to(tl.int32)
            totals += tl.load(row + 2 + d, mask=d < num_ranks, other=0)
        ok = (bad == 0) & (tl.max(totals, 0) <= total)
        received = tl.where(ok, tl.sum(tl.where(d == me, totals, 0), 0), 0)
    live = r < received
    if HAS_TOPK:
        k = tl.arange(0, K_BLOCK)[None, :]
        m = live & (k < num_k)
        raw = tl.load(ids_ptr + r * meta_words + k, mask=m, other=-1)
        local = raw - base
        here = (raw >= 0) & (local >= 0) & (local < experts_per_rank)
        pad = (r < total) & (k < num_k) & (r >= received)  # empty without PADDED
        tl.store(idx_ptr + r * num_k + k, tl.where(here & m, local, -1), mask=m | pad)
        if HAS_W:
            w = tl.load(floats_ptr + r * 2 * meta_words + 2 * meta_k + k, mask=m, other=0.0)
            tl.store(w_ptr + r * num_k + k, tl.where(here & m, w, 0.0), mask=m | pad)
    if HAS_S:
        s = tl.arange(0, S_BLOCK)[None, :]
        m = live & (s < num_scales)
        tl.store(s_ptr + r * num_scales + s, tl.load(floats_ptr + r * 2 * meta_words + 3 * meta_k + s, mask=m), mask=m)


@triton.jit
def device_clock_ns():
    # the GPU's global nanosecond timer (tests swap this helper out: the interpreter has no PTX)
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def cta_any(x):
    # 1 in every thread of the program if x != 0 in any of them, else 0 (bar.red.or: a barrier the
    # whole program reaches; tests swap this helper out). Each warp reads the clock and volatile
    # words itself, so a branch or loop exit decided on them may differ between warps; warps that
    # part ways reach different barriers, which then pair wrongly, and the shared-memory exchanges
    # after them (a reduction, a reshape) read each other's halves. Such decisions go through here.
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p<2>; setp.ne.s32 %p0, $1, 0; bar.red.or.pred %p1, 0, %p0; selp.s32 $0, 1, 0, %p1; }",
        "=r,r", [x.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_system():
    # this thread's earlier stores become visible to the whole system (other GPUs, the host) first
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_by_one():
    # thread 0's system fence. After a block barrier it puts every thread's earlier stores before
    # thread 0's later ones (bar.sync orders them before the fence, and the fence is cumulative), as
    # NCCL publishes a step: one fence a block, not one a thread (tests swap this helper out)
    tl.inline_asm_elementwise("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                              "@p fence.acq_rel.sys; mov.u32 $0, 0; }",
                              "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_by_one(addr, value):
    # thread 0 stores the int64 ``value`` at byte address ``addr`` (scalars), a system-scope store
    # that no later load waits for (tests swap this helper out)
    tl.inline_asm_elementwise("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                              "@p st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
                              "=r,l,l", [addr, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_release_system(addrs, values, mask):
    # each int64 ``values[i]`` at byte address ``addrs[i]`` where ``mask[i]``, a system-scope release
    # store (a word another GPU acquires: what this thread wrote or acquired before comes first):
    # Triton's release is an atomic exchange, whose result the thread then waits for (tests swap
    # this helper out)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,l,r", [addrs, values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_relaxed_system(addrs, values, mask):
    # store_release_system without the release, for a word whose writer needs no earlier store of
    # its own seen first (tests swap this helper out)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,l,r", [addrs, values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def exchange_call_kernel(call_ptr, words_ptr, tables_ptr, abort_ptr, landing, me, num_experts, experts_per_rank,
                         max_tokens, x_row_bytes, meta_row_bytes, timeout_ns,
                         NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, ROW: tl.constexpr, E_BLOCK: tl.constexpr,
                         PARTS: tl.constexpr):
    exchange_steps(words_ptr, tables_ptr, abort_ptr, landing, tl.load(call_ptr + C_BOARD_COPY),
                   tl.load(call_ptr + C_ROUND), tl.load(call_ptr + C_CONFIG), me, num_experts, experts_per_rank,
                   max_tokens, x_row_bytes, meta_row_bytes, timeout_ns, NUM_RANKS, R_BLOCK, ROW, E_BLOCK, PARTS)


@triton.jit
def exchange_steps(words_ptr, tables_ptr, abort_ptr, landing, board_copy, round_, config, me, num_experts,
                   experts_per_rank, max_tokens, x_row_bytes, meta_row_bytes, timeout_ns,
                   NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, ROW: tl.constexpr, E_BLOCK: tl.constexpr,
                   PARTS: tl.constexpr):
    # program d: post this rank's counts to d's board, wait for every source's row in this
    # rank's own board, then write where this rank's rows start in d (0: do not send). A row's
    # word 1 is its rank's config word (ep.wire.words), 0 for a refused input: a source whose
    # word is not this rank's config called another kind of call, so nothing is sent, and its word
    # becomes 0 here, which the padded unpack and the host read as a refusal;
    # tables_ptr: [5, R] (exchange()), one argument rather than five views on the host path
    d = tl.program_id(0)
    boards_ptr = tables_ptr
    recv_x_ptr = tables_ptr + NUM_RANKS
    recv_meta_ptr = tables_ptr + 2 * NUM_RANKS
    x_bases_ptr = tables_ptr + 3 * NUM_RANKS
    meta_bases_ptr = tables_ptr + 4 * NUM_RANKS
    r = tl.arange(0, R_BLOCK)
    m = r < NUM_RANKS
    sent = tl.load(words_ptr + r, mask=m, other=0)
    given = tl.load(words_ptr + NUM_RANKS + r, mask=m, other=0)
    q = tl.arange(0, PARTS)
    lo = tl.min(tl.load(words_ptr + 2 * NUM_RANKS + num_experts + q), 0)
    hi = tl.max(tl.load(words_ptr + 2 * NUM_RANKS + num_experts + PARTS + q), 0)
    valid = ((tl.sum((sent != given).to(tl.int32), 0) == 0) & (lo >= -1) & (hi < num_experts)).to(tl.int64)
    there = tl.load(boards_ptr + d).to(tl.pointer_type(tl.int64)) + me * ROW
    tl.store(there + 2 + r, sent, mask=m)
    for e0 in range(0, experts_per_rank, E_BLOCK):
        e = e0 + tl.arange(0, E_BLOCK)
        v = tl.load(words_ptr + 2 * NUM_RANKS + d * experts_per_rank + e, mask=e < experts_per_rank)
        tl.store(there + 2 + NUM_RANKS + e, v, mask=e < experts_per_rank)
    tl.store(there + 1, tl.where(valid != 0, config, 0))
    fence_system()  # every thread's stores reach the system before the tag does
    tl.debug_barrier()
    tl.atomic_xchg(there, round_, sem="release", scope="sys")

    own = tl.load(boards_ptr + me).to(tl.pointer_type(tl.int64))
    start = device_clock_ns()
    poll = start + ABORT_POLL_NS
    failed = tl.zeros([], dtype=tl.int32)
    ok = tl.full([], 1, dtype=tl.int64)
    below = tl.zeros([], dtype=tl.int64)
    for s in tl.static_range(NUM_RANKS):
        tag = tl.atomic_add(own + s * ROW, 0, sem="acquire", scope="sys")
        while (tag != round_) & (failed == 0):
            tag = tl.atomic_add(own + s * ROW, 0, sem="acquire", scope="sys")
            now = device_clock_ns()
            late = (now - start) > timeout_ns
            # the abort word lies in pinned host memory: read once an interval, not at every poll
            stop = tl.zeros([], dtype=tl.int1)
            if now >= poll:
                stop = tl.load(abort_ptr.to(tl.pointer_type(tl.int64)), volatile=True) >= round_
                poll = now + ABORT_POLL_NS
            failed = cta_any(late | stop)  # every warp leaves together (the loop holds barriers)
        word = tl.load(own + s * ROW + 1, volatile=True)
        if (word != config) & (tag == round_):
            tl.store(own + s * ROW + 1, 0)  # every program may store it: the same 0
        ok = ok & (word == config).to(tl.int64)
        count = tl.load(own + s * ROW + 2 + d, volatile=True)
        below += tl.where(s < me, count, 0)
    ok = ok & (failed == 0).to(tl.int64)
    shift = below - d * max_tokens  # rows[t, d] counts from d * max_tokens
    x_base = tl.load(recv_x_ptr + d) + shift * x_row_bytes
    meta_base = tl.load(recv_meta_ptr + d) + shift * meta_row_bytes
    tl.store(x_bases_ptr + d, tl.where(ok != 0, x_base, 0))
    tl.store(meta_bases_ptr + d, tl.where(ok != 0, meta_base, 0))

    # The round's board lands where the host reads it (``landing``, byte address of [R landed words,
    # the board [R, ROW], the plan's words]: ep.paths.sm_pushes, Note [Board landing]) and in the
    # call's device copy (``board_copy``, 0: none): program d lands source d's row as its wait left
    # it (its tag, and word 1 zeroed above where the source called another kind of call), program
    # 0 the plan's words; then, every store before it, its landed word.
    tl.debug_barrier()  # (this program's store of word 1, above, before any thread reads the row)
    landed_ptr = landing.to(tl.pointer_type(tl.int64))
    used = 2 + NUM_RANKS + experts_per_rank  # (the rest of a row is never read)
    for c0 in range(0, used, E_BLOCK):
        c = c0 + tl.arange(0, E_BLOCK)
        row = tl.load(own + d * ROW + c, mask=c < used, volatile=True)
        tl.store(landed_ptr + NUM_RANKS + d * ROW + c, row, mask=c < used)
        if board_copy != 0:
            tl.store(board_copy.to(tl.pointer_type(tl.int64)) + d * ROW + c, row, mask=c < used)
    if d == 0:
        num_words = 2 * NUM_RANKS + num_experts + 2 * PARTS
        for w0 in range(0, num_words, E_BLOCK):
            w = w0 + tl.arange(0, E_BLOCK)
            tl.store(landed_ptr + NUM_RANKS + NUM_RANKS * ROW + w, tl.load(words_ptr + w, mask=w < num_words),
                     mask=w < num_words)
    fence_system()
    tl.debug_barrier()
    tl.store(landed_ptr + d, 1)


@triton.jit
def push_kernel(rows_ptr, x_ptr, x_bases_ptr, meta_bases_ptr, x_words, num_tokens, topk_ptr, w_ptr, s_ptr,
                num_k, num_scales, s_token_stride, s_col_stride, meta_words, meta_k, skip,
                NUM_RANKS: tl.constexpr, X_BLOCK: tl.constexpr, CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr,
                S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr):
    push_steps(rows_ptr, x_ptr, x_bases_ptr, meta_bases_ptr, x_words, num_tokens, topk_ptr, w_ptr, s_ptr, num_k,
               num_scales, s_token_stride, s_col_stride, meta_words, meta_k, skip, NUM_RANKS, X_BLOCK, CHUNKS, K_BLOCK,
               S_BLOCK, HAS_TOPK, HAS_W, HAS_S)


@triton.jit
def push_call_kernel(call_ptr, x_bases_ptr, meta_bases_ptr, x_words, num_k, num_scales, meta_words, meta_k,
                     NUM_RANKS: tl.constexpr, X_BLOCK: tl.constexpr, CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr,
                     S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr,
                     TOPK_T: tl.constexpr, W_T: tl.constexpr):
    # the scales' strides are per-call words too: a graph serves either layout (ep.kernels.call_block.CALL_SLOTS)
    push_steps(call_pointer(call_ptr, C_ROWS, tl.int64), call_pointer(call_ptr, C_X, tl.int64), x_bases_ptr,
               meta_bases_ptr, x_words, tl.load(call_ptr + C_TOKENS).to(tl.int32), call_pointer(call_ptr, C_TOPK, TOPK_T),
               call_pointer(call_ptr, C_WEIGHTS, W_T), call_pointer(call_ptr, C_SCALES, tl.float32), num_k, num_scales,
               tl.load(call_ptr + C_SCALES_TOKEN_STRIDE), tl.load(call_ptr + C_SCALES_COL_STRIDE), meta_words, meta_k,
               -1, NUM_RANKS, X_BLOCK, CHUNKS, K_BLOCK, S_BLOCK, HAS_TOPK, HAS_W, HAS_S)


@triton.jit
def push_steps(rows_ptr, x_ptr, x_bases_ptr, meta_bases_ptr, x_words, num_tokens, topk_ptr, w_ptr, s_ptr,
               num_k, num_scales, s_token_stride, s_col_stride, meta_words, meta_k, skip,
               NUM_RANKS: tl.constexpr, X_BLOCK: tl.constexpr, CHUNKS: tl.constexpr, K_BLOCK: tl.constexpr,
               S_BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr):
    # gather_kernel's rows, stored by the SMs straight into each destination's area: byte
    # address bases[d] (a peer's mapped region, or this rank's own) is row 0 of rows[:, d]; 0
    # means "not this destination". Each program loops over tokens (a persistent grid). Its
    # accesses are 8 bytes wide (Triton cannot see the alignment of addresses it loads); 16-byte
    # ones, through tl.multiple_of hints, measured no faster: NVLink, not issue, bounds the push.
    kc = tl.arange(0, K_BLOCK)
    sc = tl.arange(0, S_BLOCK)
    for t in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        t = t + tl.zeros([], dtype=tl.int64)  # 64-bit offsets (a Python int in the interpreter)
        for c in tl.static_range(CHUNKS):
            cols = c * X_BLOCK + tl.arange(0, X_BLOCK)
            in_row = cols < x_words
            row = tl.load(x_ptr + t * x_words + cols, mask=in_row)
            for d in tl.static_range(NUM_RANKS):
                if d != skip:
                    at = tl.load(rows_ptr + t * NUM_RANKS + d)
                    base = tl.load(x_bases_ptr + d)
                    if (at >= 0) & (base != 0):
                        tl.store(base.to(tl.pointer_type(tl.int64)) + at * x_words + cols, row, mask=in_row)
        ids, ws, ss = meta_parts(topk_ptr, w_ptr, s_ptr, t, num_k, num_scales, s_token_stride, s_col_stride, kc, sc,
                                 HAS_TOPK, HAS_W, HAS_S)
        for d in tl.static_range(NUM_RANKS):
            if d != skip:
                at = tl.load(rows_ptr + t * NUM_RANKS + d)
                base = tl.load(meta_bases_ptr + d)
                if (at >= 0) & (base != 0):
                    if HAS_TOPK:
                        tl.store(base.to(tl.pointer_type(tl.int64)) + at * meta_words + kc, ids, mask=kc < num_k)
                    if HAS_W:
                        floats = base.to(tl.pointer_type(tl.float32)) + at * 2 * meta_words
                        tl.store(floats + 2 * meta_k + kc, ws, mask=kc < num_k)
                    if HAS_S:
                        floats = base.to(tl.pointer_type(tl.float32)) + at * 2 * meta_words
                        tl.store(floats + 3 * meta_k + sc, ss, mask=sc < num_scales)
