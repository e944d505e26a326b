"""The low-latency ``dispatch`` kernel: its send phase, its receive phase, and the entry point running
either or both (Note [Low-latency device path] in ep.low_latency._device; shared parts in
ep.low_latency._triton)."""

import triton
import triton.language as tl

from warmlink.ep.kernels.programs import device_clock_ns, store_release_system
from warmlink.ep.low_latency._triton import (ACK_BLOCK, F_MISMATCH, F_REFUSED, NO_RANK, REFUSED_COUNT, S_DONE_SEND,
                                             acknowledge, healthy, last_program, live_snapshot, on_live_rank, report,
                                             symbol, wait_words)


# -- dispatch ---------------------------------------------------------------------------------------
@triton.jit
def dispatch_send(x_ptr, topk_ptr, count_ptr, bases_ptr, state_ptr, fail_ptr, mask_ptr, dispatched_ptr, own, me,
                  num_tokens, num_cols, num_experts, tokens, disp_off, meta_off, signal_off, ack_off, seq_slot, tag,
                  timeout_ns, q,
                  NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr, L_BLOCK: tl.constexpr,
                  HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr, NUM_TOPK: tl.constexpr, K_BLOCK: tl.constexpr,
                  BLOCK: tl.constexpr, FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, SHRINK: tl.constexpr):
    # each program's tokens (cast to FP8 on request) into slot (e, me) of each of its experts' ranks,
    # with its meta word t * K + k; a slot is the entry's rank among this rank's entries to the same
    # expert in token order, which every program counts from topk_idx itself (no count exchange,
    # no kernel before this one). The last program to finish writes the signal words of every
    # (destination, local expert), then advances this parity's dispatch sequence number.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    # nothing a destination has not read yet is overwritten (Note [Low-latency device path]): a
    # token's rows wait for the acks of its own slots, and each program waits for its share of
    # every (destination, local expert)'s ack word here, as the last program writes every slot's
    # signal word, empty slots' too. Not every word in every program: the send then took 1.2 us more
    acks = (own + ack_off).to(tl.pointer_type(tl.int64))
    for a0 in range(pid * ACK_BLOCK, NUM_RANKS * LOCAL, grid * ACK_BLOCK):
        i = a0 + tl.arange(0, ACK_BLOCK)
        wait_words(acks + i, i < NUM_RANKS * LOCAL, q - 1, device_clock_ns(), i // LOCAL, state_ptr, fail_ptr, mask_ptr,
                   seq_slot, q, timeout_ns, 0, True, SHRINK, False)
    num_entries = num_tokens * num_cols
    offs = tl.arange(0, BLOCK)
    # every program reads every id: one out of range refuses the round. Counted per lane, summed
    # once: a sum across the program is a barrier
    out_of_range = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_entries, BLOCK):
        v = tl.load(topk_ptr + start + offs, mask=start + offs < num_entries, other=-1).to(tl.int64)
        out_of_range += ((v < -1) | (v >= num_experts)).to(tl.int32)
    bad = tl.sum(out_of_range, 0)
    go = healthy(state_ptr) & (bad == 0)
    kk = tl.arange(0, K_BLOCK)
    km = kk < num_cols
    for tok in range(pid, num_tokens, grid):
        t = tok + tl.zeros([], dtype=tl.int64)  # (a plain int in the interpreter)
        ek = tl.load(topk_ptr + t * num_cols + kk, mask=km, other=-1).to(tl.int64)
        tl.store(dispatched_ptr + t * NUM_TOPK + kk, (ek >= 0).to(tl.int8), mask=km)
        if go:
            owner = tl.where(ek >= 0, ek // LOCAL, 0)  # (// truncates: -1 // LOCAL would be rank 0 anyway)
            # this parity's previous round of the token's slots (e, me) was read
            _, failed = wait_words(acks + owner * LOCAL + ek % LOCAL, km & (ek >= 0), q - 1, device_clock_ns(), owner,
                                   state_ptr, fail_ptr, mask_ptr, seq_slot, q, timeout_ns, 0, True, SHRINK, False)
            live = live_snapshot(mask_ptr, r, rm, R_BLOCK, SHRINK)
            # the entries to count and send ([K]: the interpreter refuses a mask and-ed with a scalar)
            ok = km & (ek >= 0) & ((failed + tl.zeros_like(kk)) == 0)
            hits = tl.zeros([K_BLOCK, BLOCK], dtype=tl.int32)  # entries before (t, k) that go to ek[k]
            pos = t * num_cols + kk
            for start in range(0, (tok + 1) * num_cols, BLOCK):
                i = start + offs
                v = tl.load(topk_ptr + i, mask=i < num_entries, other=-1).to(tl.int64)
                hits += ((v[None, :] == ek[:, None]) & (i[None, :] < pos[:, None])).to(tl.int32)
            slot = tl.sum(hits, 1).to(tl.int64)
            tl.atomic_add(count_ptr + ek, tl.zeros_like(kk) + 1, mask=ok, sem="relaxed", scope="gpu")
            nb = tl.arange(0, H_BLOCK // 128)
            w = tl.arange(0, H_BLOCK // 8) if FP8 else tl.arange(0, H_BLOCK // 4)
            if FP8:  # as ep.low_latency._cast.cast_fp8
                cols = tl.arange(0, H_BLOCK)
                xv = tl.load(x_ptr + t * HIDDEN + cols, mask=cols < HIDDEN, other=0.0)
                blocks = tl.reshape(xv.to(tl.float32), (H_BLOCK // 128, 128))
                amax = tl.maximum(tl.max(tl.abs(blocks), 1), 1e-4)
                scale = tl.div_rn(amax, 448.0)
                if ROUND_SCALE:  # up to a power of two, exactly: the next exponent unless the mantissa is 0
                    bits = scale.to(tl.int32, bitcast=True)
                    scale = (((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23).to(tl.float32, bitcast=True)
                qx = tl.clamp(tl.div_rn(blocks, scale[:, None]), -448.0, 448.0)
                qx = tl.reshape(qx, (H_BLOCK // 8, 8)).to(tl.float8e4nv, fp_downcast_rounding="rtne")
                # eight bytes to a word: the stores into the peer are 8 bytes wide, not one
                shifts = (tl.arange(0, 8) * 8).to(tl.int64)
                row_words = tl.sum(qx.to(tl.uint8, bitcast=True).to(tl.int64) << shifts[None, :], 1)
            else:
                row_words = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + t * (HIDDEN // 4) + w, mask=w < HIDDEN // 4)
            # every column's row at once (no loop over the columns: each would wait for its own
            # address): slot (e, me) of each entry's expert, on a live rank
            send = ok & on_live_rank(owner, live, r)
            row = ((ek % LOCAL) * NUM_RANKS + me) * tokens + slot
            base = tl.load(bases_ptr + owner, mask=send, other=0)
            at = base + disp_off + row * (2 * HIDDEN)
            words: tl.constexpr = HIDDEN // 8 if FP8 else HIDDEN // 4
            tl.store(at.to(tl.pointer_type(tl.int64))[:, None] + w[None, :], row_words[None, :],
                     mask=send[:, None] & (w < words)[None, :])
            if FP8:
                tl.store((at + HIDDEN).to(tl.pointer_type(tl.float32))[:, None] + nb[None, :], scale[None, :],
                         mask=send[:, None] & (nb < HIDDEN // 128)[None, :])
            tl.store((base + meta_off + row * 8).to(tl.pointer_type(tl.int64)), t * NUM_TOPK + kk, mask=send)
    if last_program(state_ptr, S_DONE_SEND + seq_slot, grid):
        if healthy(state_ptr):
            el = tl.arange(0, L_BLOCK)
            m = el < LOCAL
            live = live_snapshot(mask_ptr, r, rm, R_BLOCK, SHRINK)
            for d in range(NUM_RANKS):
                if tl.sum((live & (r == d)).to(tl.int32), 0) > 0:
                    c = tl.load(count_ptr + d * LOCAL + el, mask=m, other=0, volatile=True).to(tl.int64)
                    c = tl.where(bad != 0, REFUSED_COUNT, c)
                    at = tl.load(bases_ptr + d) + signal_off + (el * NUM_RANKS + me) * 8
                    # tag widened first (an int32 argument, or a constexpr when 1): shifted into bit 31 it would
                    # sign-extend over the seq
                    store_release_system(at, (q << 32) | ((tag + tl.zeros([], dtype=tl.int64)) << 24) | c, m)
        # every thread has read its counts before any thread zeroes them: the reads and the zeroing
        # below split the counts among the threads differently
        tl.debug_barrier()
        for first in range(0, num_experts, BLOCK):  # the counts start at zero for this parity's next round
            tl.store(count_ptr + first + offs, tl.zeros_like(offs), mask=first + offs < num_experts)
        tl.store(state_ptr + seq_slot, q)


@triton.jit
def dispatch_recv(bases_ptr, x_out_ptr, scales_out_ptr, count_out_ptr, src_info_ptr, range_ptr, comb_slot_ptr,
                  cum_stats_ptr, wait_stats_ptr, state_ptr, fail_ptr, mask_ptr, own, me, tokens, disp_off, meta_off,
                  signal_off, ack_off, seq_slot, tag, timeout_ns, q,
                  NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr, HIDDEN: tl.constexpr,
                  W_BLOCK: tl.constexpr, NUM_TOPK: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                  S_BLOCK: tl.constexpr, HAS_CUM: tl.constexpr, HAS_WAIT: tl.constexpr, SHRINK: tl.constexpr,
                  ROWS: tl.constexpr):
    # item (e, s) of each program: wait for every source's signal word of local expert e, then pack
    # source s's rows of e after those of the sources below it (DeepEP's layout, in a fixed order)
    # and tell s that its slot of e was read (its ack word of (this rank, e) there); a masked source
    # sends nothing. An ack a slot, not one a round after a count of the programs: the count and a
    # system-scope release after it were a fifth of this phase on one H200
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    for item in range(pid, LOCAL * NUM_RANKS, grid):
        e = item // NUM_RANKS + tl.zeros([], dtype=tl.int64)
        s = item % NUM_RANKS + tl.zeros([], dtype=tl.int64)
        if healthy(state_ptr):
            signals = (own + signal_off + (e * NUM_RANKS + r) * 8).to(tl.pointer_type(tl.int64))
            start = device_clock_ns()
            # every source's count (the rows below source s's come first); with wait stats, source
            # s's alone first, the wait its stats count
            if HAS_WAIT:
                words, failed = wait_words(signals, r == s, q, start, r, state_ptr, fail_ptr, mask_ptr, seq_slot, q,
                                           timeout_ns, 32, False, SHRINK)
                if e == 0:
                    tl.atomic_add(wait_stats_ptr + s, device_clock_ns() - start)
                if failed == 0:
                    words, failed = wait_words(signals, rm, q, start, r, state_ptr, fail_ptr, mask_ptr, seq_slot, q,
                                               timeout_ns, 32, False, SHRINK)
            else:
                words, failed = wait_words(signals, rm, q, start, r, state_ptr, fail_ptr, mask_ptr, seq_slot, q,
                                           timeout_ns, 32, False, SHRINK)
            if failed == 0:
                live = live_snapshot(mask_ptr, r, rm, R_BLOCK, SHRINK)
                counts = words & 0xFFFFFF
                tags = (words >> 24) & 0xFF
                if tl.sum((live & (tags != tag)).to(tl.int32), 0) > 0:
                    report(fail_ptr, F_MISMATCH, seq_slot, q, tl.min(tl.where(live & (tags != tag), r, NO_RANK), 0))
                elif tl.sum((live & (counts == REFUSED_COUNT)).to(tl.int32), 0) > 0:
                    report(fail_ptr, F_REFUSED, seq_slot, q,
                           tl.min(tl.where(live & (counts == REFUSED_COUNT), r, NO_RANK), 0))
                else:
                    counts = tl.where(live, counts, 0)
                    begin = tl.sum(tl.where(r < s, counts, 0), 0)
                    mine = tl.sum(tl.where(r == s, counts, 0), 0)
                    per_expert = NUM_RANKS * tokens
                    if s == 0:
                        total = tl.sum(counts, 0)
                        tl.store(count_out_ptr + e, total.to(tl.int32))
                        if HAS_CUM:  # an atomic whose result nothing waits for: a load, then a store, would
                            # hold the program a memory latency (the stats are cold in a decode step)
                            tl.atomic_add(cum_stats_ptr + e, total.to(tl.int32), sem="relaxed", scope="gpu")
                    tl.store(range_ptr + e * NUM_RANKS + s, (begin << 32) | mine)
                    words_per_row: tl.constexpr = HIDDEN // 8 if FP8 else HIDDEN // 4
                    w = tl.arange(0, W_BLOCK)
                    wm = w < words_per_row
                    sc = tl.arange(0, S_BLOCK)
                    num_scales: tl.constexpr = HIDDEN // 128
                    # ROWS rows a step, every load of them issued before their stores: one memory
                    # latency a step, not one a row
                    ri = tl.arange(0, ROWS)
                    for i0 in range(0, mine, ROWS):
                        i = i0 + ri
                        im = i < mine
                        slot = (e * NUM_RANKS + s) * tokens + i
                        at = own + disp_off + slot * (2 * HIDDEN)
                        row = begin + i  # within expert e's block
                        flat = e * per_expert + row
                        # rows start 16-byte aligned (the hint goes on the pointers: it crosses no
                        # int-to-pointer cast): 16-byte loads and stores
                        src = tl.multiple_of(at.to(tl.pointer_type(tl.int64)), 16)
                        data = tl.load(src[:, None] + w[None, :], mask=im[:, None] & wm[None, :])
                        meta = tl.load((own + meta_off + slot * 8).to(tl.pointer_type(tl.int64)), mask=im)
                        if FP8:
                            scales = tl.load((at + HIDDEN).to(tl.pointer_type(tl.float32))[:, None] + sc[None, :],
                                             mask=im[:, None] & (sc < num_scales)[None, :], other=0.0)
                        dst = tl.multiple_of(x_out_ptr.to(tl.pointer_type(tl.int64)), 16)
                        tl.store(dst + flat[:, None] * words_per_row + w[None, :], data, mask=im[:, None] & wm[None, :])
                        if FP8:
                            if UE8M0:  # four biased exponents per int32, byte j of word c is block 4c + j
                                ex = (scales.to(tl.int32, bitcast=True) >> 23) & 0xFF
                                ex = tl.reshape(ex, (ROWS, S_BLOCK // 4, 4)) << (tl.arange(0, 4) * 8)[None, None, :]
                                packed = tl.sum(ex, 2)
                                pc = tl.arange(0, S_BLOCK // 4)
                                num_packed: tl.constexpr = (num_scales + 3) // 4
                                tl.store(scales_out_ptr.to(tl.pointer_type(tl.int32)) + e * num_packed * per_expert
                                         + pc[None, :] * per_expert + row[:, None], packed,
                                         mask=im[:, None] & (pc < num_packed)[None, :])
                            else:  # column-major in the last two dimensions, as DeepEP's
                                tl.store(scales_out_ptr.to(tl.pointer_type(tl.float32)) + e * num_scales * per_expert
                                         + sc[None, :] * per_expert + row[:, None], scales,
                                         mask=im[:, None] & (sc < num_scales)[None, :])
                        tl.store(src_info_ptr + flat, (meta // NUM_TOPK).to(tl.int32), mask=im)
                        tl.store(comb_slot_ptr + flat, meta, mask=im)
                acknowledge(bases_ptr, mask_ptr, ack_off, me * LOCAL + e, q, r, rm & (r == s), SHRINK)


def _dispatch(x_ptr, topk_ptr, cum_stats_ptr, wait_stats_ptr, num_tokens, num_cols, tokens, tag,
              bases_ptr, state_ptr, mask_ptr, counts_ptr, dispatched_ptr, x_out_ptr, scales_out_ptr, packed_out_ptr,
              count_out_ptr, src_info_ptr, range_ptr, comb_slot_ptr, fail_ptr, own, me, disp_off, meta_off, signal_off,
              ack_off, timeout_ns, num_experts, seq_slot,
              PHASE: tl.constexpr, NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr,
              L_BLOCK: tl.constexpr, HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr, W_BLOCK: tl.constexpr,
              S_BLOCK: tl.constexpr, NUM_TOPK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
              FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr, HAS_CUM: tl.constexpr,
              HAS_WAIT: tl.constexpr, SHRINK: tl.constexpr, ROWS: tl.constexpr):
    # the send (PHASE 1 or 3), then the receive (PHASE 2 or 3) of a dispatch; in one launch, the
    # receive's round is the one this launch's send made. The arguments after ``tag`` are the same
    # for every call of a parity (ep.low_latency._device's ``_fixed``): parameters, not words in
    # memory, so that a program's first load is its state word, not an address to load it from.
    # bases, state, mask and counts come as tensors, the other addresses as ints, cast here
    q = tl.load(state_ptr + seq_slot)  # advanced by the send, this launch's or an earlier one's
    if PHASE % 2 == 1:  # SEND or BOTH
        q += 1
        dispatch_send(x_ptr, topk_ptr, counts_ptr, bases_ptr, state_ptr, fail_ptr, mask_ptr,
                      dispatched_ptr.to(tl.pointer_type(tl.int8)), own, me,
                      num_tokens, num_cols, num_experts, tokens, disp_off, meta_off, signal_off, ack_off, seq_slot, tag,
                      timeout_ns, q, NUM_RANKS, R_BLOCK, LOCAL, L_BLOCK, HIDDEN, H_BLOCK, NUM_TOPK, K_BLOCK, BLOCK, FP8,
                      ROUND_SCALE, SHRINK)
    if PHASE // 2 == 1:  # RECV or BOTH
        dispatch_recv(bases_ptr, x_out_ptr, packed_out_ptr if UE8M0 else scales_out_ptr,
                      count_out_ptr.to(tl.pointer_type(tl.int32)), src_info_ptr.to(tl.pointer_type(tl.int32)),
                      range_ptr.to(tl.pointer_type(tl.int64)), comb_slot_ptr.to(tl.pointer_type(tl.int64)),
                      cum_stats_ptr, wait_stats_ptr, state_ptr, fail_ptr, mask_ptr, own, me, tokens, disp_off, meta_off,
                      signal_off, ack_off, seq_slot, tag, timeout_ns, q, NUM_RANKS, R_BLOCK, LOCAL, HIDDEN, W_BLOCK,
                      NUM_TOPK, FP8, UE8M0, S_BLOCK, HAS_CUM, HAS_WAIT, SHRINK, ROWS)


# the ints a call passes are not specialized on their values: one compiled kernel (and one prepared
# launch: ep.low_latency._device) serves every token count, width and tag; nor are the small ints
# of a parity (this rank, the parity, offsets that may be 1)
dispatch = triton.jit(_dispatch, repr=symbol("dispatch"),
                      do_not_specialize=["num_tokens", "num_cols", "tokens", "tag", "me", "disp_off", "meta_off",
                                         "signal_off", "ack_off", "timeout_ns", "num_experts", "seq_slot"])
