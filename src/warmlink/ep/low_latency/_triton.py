"""The Triton kernels of low-latency mode on a GPU (ep.low_latency._device launches them).

See Note [Low-latency device path] in ep.low_latency._device. Imported only where Triton is; tests
run every kernel through Triton's interpreter on host memory, with the clock and the fence
swapped for Python ones.
"""

import triton
import triton.language as tl

from warmlink.ep.kernels.programs import device_clock_ns, fence_system

# The device state words (ep.low_latency._device.STATE_WORDS, in this order)
# (words 0-3: the sequence numbers of dispatch and combine, by parity: a kernel's ``seq_slot``)
S_FAILED = tl.constexpr(4)  # a wait timed out: every later kernel does nothing
S_BAD = tl.constexpr(5)  # + seq_slot: this parity's dispatch holds an expert id outside [-1, E)
# + seq_slot: programs of a send / receive kernel that finished (the last one signals); per phase
# and parity, so that calls of the two parities may run on two streams at once
S_DONE_SEND = tl.constexpr(8)
S_DONE_RECV = tl.constexpr(12)
# Failure codes, in the pinned host word the next call reads
F_TIMEOUT = tl.constexpr(1)
F_MISMATCH = tl.constexpr(2)
F_REFUSED = tl.constexpr(3)
F_UNMASKED = tl.constexpr(4)
REFUSED_COUNT = tl.constexpr(0xFFFFFF)  # the count of a signal word whose sender refused its input
_BIG = tl.constexpr(1 << 30)


@triton.jit
def report(fail_ptr, code, slot, seq, rank):
    # the failure's details, then its code (the host reads the code first)
    f = fail_ptr.to(tl.pointer_type(tl.int64))
    zero = tl.zeros([], dtype=tl.int64)
    tl.store(f + 1, zero + slot)
    tl.store(f + 2, zero + seq)
    tl.store(f + 3, zero + rank)
    tl.atomic_xchg(f, zero + code, sem="release", scope="sys")


@triton.jit
def spin(ptrs, mask, want, start, timeout_ns, SHIFT: tl.constexpr, AT_LEAST: tl.constexpr):
    # bounded spin until every masked word's ``word >> SHIFT`` equals (AT_LEAST: reaches) ``want``;
    # returns (the words, 1 if the deadline passed first)
    words = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
    if AT_LEAST:
        missing = tl.sum((mask & ((words >> SHIFT) < want)).to(tl.int32), 0)
    else:
        missing = tl.sum((mask & ((words >> SHIFT) != want)).to(tl.int32), 0)
    late = tl.zeros([], dtype=tl.int32)
    while (missing > 0) & (late == 0):
        words = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
        if AT_LEAST:
            missing = tl.sum((mask & ((words >> SHIFT) < want)).to(tl.int32), 0)
        else:
            missing = tl.sum((mask & ((words >> SHIFT) != want)).to(tl.int32), 0)
        late = ((device_clock_ns() - start) > timeout_ns).to(tl.int32)
    late = (missing > 0).to(tl.int32)
    tl.debug_barrier()  # the rows this program reads next are ordered after the acquire, in every thread
    return words, late


@triton.jit
def first_missing(mask, words, want, r, SHIFT: tl.constexpr, AT_LEAST: tl.constexpr):
    if AT_LEAST:
        behind = mask & ((words >> SHIFT) < want)
    else:
        behind = mask & ((words >> SHIFT) != want)
    return tl.min(tl.where(behind, r, _BIG), 0)


@triton.jit
def wait_or_fail(ptrs, mask, want, start, timeout_ns, r, state_ptr, fail_ptr, seq_slot, q,
                 SHIFT: tl.constexpr, AT_LEAST: tl.constexpr):
    # spin; past the deadline report a rank among those this wait read, and mark the device state
    # failed (every later kernel does nothing); returns the words and 1 if the wait timed out
    words, late = spin(ptrs, mask, want, start, timeout_ns, SHIFT, AT_LEAST)
    if late != 0:
        report(fail_ptr, F_TIMEOUT, seq_slot, q, first_missing(mask, words, want, r, SHIFT, AT_LEAST))
        tl.store(state_ptr + S_FAILED, 1)
    return words, late


@triton.jit
def last_program(state_ptr, slot, total):
    # every thread's earlier stores reach the system, then count this program done; 1 in the
    # program that finished last (it resets the count for the next call)
    fence_system()
    tl.debug_barrier()
    done = tl.atomic_add(state_ptr + slot, 1, sem="acq_rel", scope="gpu")
    last = done == total - 1
    if last:
        tl.store(state_ptr + slot, 0)
    return last


# -- dispatch ---------------------------------------------------------------------------------------
@triton.jit
def slots_kernel(topk_ptr, slot_ptr, count_ptr, state_ptr, mask_ptr, num_entries, num_cols, num_experts, seq_slot,
                 NUM_TOPK: tl.constexpr, BLOCK: tl.constexpr):
    # program e < E: the slot of each (token, column) that goes to expert e (its rank among this
    # rank's rows to e, in token order) and e's count; program E: whether any id is out of range,
    # and the handle's mask of the entries sent ([T, NUM_TOPK] storage)
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if e < num_experts:
        carry = tl.zeros([], dtype=tl.int32)
        for start in range(0, num_entries, BLOCK):
            i = start + offs
            m = i < num_entries
            hit = (tl.load(topk_ptr + i, mask=m, other=-1).to(tl.int64) == e).to(tl.int32)
            incl = tl.cumsum(hit, 0)
            tl.store(slot_ptr + i, carry + incl - 1, mask=m & (hit != 0))
            carry += tl.sum(hit, 0)
        tl.store(count_ptr + e, carry)
    else:
        bad = tl.zeros([], dtype=tl.int32)
        for start in range(0, num_entries, BLOCK):
            i = start + offs
            v = tl.load(topk_ptr + i, mask=i < num_entries, other=-1).to(tl.int64)
            bad += tl.sum(((v < -1) | (v >= num_experts)).to(tl.int32), 0)
            tl.store(mask_ptr + (i // num_cols) * NUM_TOPK + i % num_cols, v >= 0, mask=i < num_entries)
        tl.store(state_ptr + S_BAD + seq_slot, (bad > 0).to(tl.int64))


@triton.jit
def dispatch_send_kernel(x_ptr, topk_ptr, slot_ptr, count_ptr, bases_ptr, state_ptr, fail_ptr, me, num_tokens,
                         num_cols, tokens, disp_off, meta_off, signal_off, ack_off, seq_slot, tag, timeout_ns,
                         NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr, L_BLOCK: tl.constexpr,
                         HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr, NUM_TOPK: tl.constexpr, FP8: tl.constexpr,
                         ROUND_SCALE: tl.constexpr):
    # program t: token t (cast to FP8 on request) into slot (e, me) of each of its experts' ranks,
    # with its meta word t * K + k; the last program to finish writes the signal words of every
    # (destination, local expert), then advances this parity's dispatch sequence number
    t = tl.program_id(0).to(tl.int64)
    q = tl.load(state_ptr + seq_slot) + 1
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    own = tl.load(bases_ptr + me)
    # every destination received this parity's previous round (its ack word here), so nothing it
    # has not read yet is overwritten (Note [Low-latency device path])
    acks = (own + ack_off + r * 8).to(tl.pointer_type(tl.int64))
    wait_or_fail(acks, rm, q - 1, device_clock_ns(), timeout_ns, r, state_ptr, fail_ptr, seq_slot, q, 0, True)
    go = (tl.load(state_ptr + S_FAILED, volatile=True) == 0) & (tl.load(state_ptr + S_BAD + seq_slot) == 0)
    if go & (t < num_tokens):
        nb = tl.arange(0, H_BLOCK // 128)
        w = tl.arange(0, H_BLOCK // 8) if FP8 else tl.arange(0, H_BLOCK // 4)
        if FP8:  # as ep.low_latency._cast.cast_fp8
            cols = tl.arange(0, H_BLOCK)
            v = tl.load(x_ptr + t * HIDDEN + cols, mask=cols < HIDDEN, other=0.0)
            blocks = tl.reshape(v.to(tl.float32), (H_BLOCK // 128, 128))
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
        for k in range(num_cols):
            e = tl.load(topk_ptr + t * num_cols + k).to(tl.int64)
            if e >= 0:
                d = e // LOCAL
                row = ((e % LOCAL) * NUM_RANKS + me) * tokens + tl.load(slot_ptr + t * num_cols + k).to(tl.int64)
                base = tl.load(bases_ptr + d)
                at = base + disp_off + row * (2 * HIDDEN)
                if FP8:
                    tl.store(at.to(tl.pointer_type(tl.int64)) + w, row_words, mask=w < HIDDEN // 8)
                    tl.store((at + HIDDEN).to(tl.pointer_type(tl.float32)) + nb, scale, mask=nb < HIDDEN // 128)
                else:
                    tl.store(at.to(tl.pointer_type(tl.int64)) + w, row_words, mask=w < HIDDEN // 4)
                tl.store((base + meta_off + row * 8).to(tl.pointer_type(tl.int64)), t * NUM_TOPK + k)
    if last_program(state_ptr, S_DONE_SEND + seq_slot, tl.num_programs(0)):
        if tl.load(state_ptr + S_FAILED, volatile=True) == 0:
            refused = tl.load(state_ptr + S_BAD + seq_slot) != 0
            el = tl.arange(0, L_BLOCK)
            m = el < LOCAL
            for d in range(NUM_RANKS):
                c = tl.load(count_ptr + d * LOCAL + el, mask=m, other=0).to(tl.int64)
                c = tl.where(refused, REFUSED_COUNT, c)
                at = tl.load(bases_ptr + d) + signal_off + (el * NUM_RANKS + me) * 8
                # tag widened first (an int32 argument, or a constexpr when 1): shifted into bit 31 it would
                # sign-extend over the seq
                tl.atomic_xchg(at.to(tl.pointer_type(tl.int64)), (q << 32) | ((tag + tl.zeros([], dtype=tl.int64)) << 24) | c, mask=m,
                               sem="release", scope="sys")
        tl.store(state_ptr + seq_slot, q)


@triton.jit
def dispatch_recv_kernel(bases_ptr, x_out_ptr, scales_out_ptr, count_out_ptr, src_info_ptr, range_ptr, comb_slot_ptr,
                         cum_stats_ptr, wait_stats_ptr, state_ptr, fail_ptr, me, tokens, disp_off, meta_off, signal_off,
                         ack_off, seq_slot, tag, timeout_ns,
                         NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr, HIDDEN: tl.constexpr,
                         W_BLOCK: tl.constexpr, NUM_TOPK: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                         S_BLOCK: tl.constexpr, HAS_CUM: tl.constexpr, HAS_WAIT: tl.constexpr):
    # program (e, s): wait for every source's signal word of local expert e, then pack source s's
    # rows of e after those of the sources below it (DeepEP's layout, in a fixed order); the last
    # program to finish tells every source that this parity's round was read (its ack word there)
    e = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    q = tl.load(state_ptr + seq_slot)  # advanced by this rank's own send
    own = tl.load(bases_ptr + me)
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    if tl.load(state_ptr + S_FAILED, volatile=True) == 0:
        signals = (own + signal_off + (e * NUM_RANKS + r) * 8).to(tl.pointer_type(tl.int64))
        start = device_clock_ns()
        # source s first (the wait its stats count), then every source (the counts below it)
        words, late = wait_or_fail(signals, r == s, q, start, timeout_ns, r, state_ptr, fail_ptr, seq_slot, q, 32,
                                   False)
        if HAS_WAIT & (e == 0):
            tl.atomic_add(wait_stats_ptr + s, device_clock_ns() - start)
        if late == 0:
            words, late = wait_or_fail(signals, rm, q, start, timeout_ns, r, state_ptr, fail_ptr, seq_slot, q, 32,
                                       False)
        if late == 0:
            counts = words & 0xFFFFFF
            tags = (words >> 24) & 0xFF
            if tl.sum((rm & (tags != tag)).to(tl.int32), 0) > 0:
                report(fail_ptr, F_MISMATCH, seq_slot, q, tl.min(tl.where(rm & (tags != tag), r, _BIG), 0))
            elif tl.sum((rm & (counts == REFUSED_COUNT)).to(tl.int32), 0) > 0:
                report(fail_ptr, F_REFUSED, seq_slot, q, tl.min(tl.where(rm & (counts == REFUSED_COUNT), r, _BIG), 0))
            else:
                counts = tl.where(rm, counts, 0)
                begin = tl.sum(tl.where(r < s, counts, 0), 0)
                mine = tl.sum(tl.where(r == s, counts, 0), 0)
                per_expert = NUM_RANKS * tokens
                if s == 0:
                    total = tl.sum(counts, 0)
                    tl.store(count_out_ptr + e, total.to(tl.int32))
                    if HAS_CUM:
                        tl.store(cum_stats_ptr + e, tl.load(cum_stats_ptr + e) + total.to(tl.int32))
                tl.store(range_ptr + e * NUM_RANKS + s, (begin << 32) | mine)
                words_per_row: tl.constexpr = HIDDEN // 8 if FP8 else HIDDEN // 4
                w = tl.arange(0, W_BLOCK)
                sc = tl.arange(0, S_BLOCK)
                num_scales: tl.constexpr = HIDDEN // 128
                for i in range(mine):
                    slot = (e * NUM_RANKS + s) * tokens + i
                    at = own + disp_off + slot * (2 * HIDDEN)
                    row = begin + i  # within expert e's block
                    flat = e * per_expert + row
                    data = tl.load(at.to(tl.pointer_type(tl.int64)) + w, mask=w < words_per_row)
                    tl.store(x_out_ptr.to(tl.pointer_type(tl.int64)) + flat * words_per_row + w, data,
                             mask=w < words_per_row)
                    if FP8:
                        scales = tl.load((at + HIDDEN).to(tl.pointer_type(tl.float32)) + sc, mask=sc < num_scales,
                                         other=0.0)
                        if UE8M0:  # four biased exponents per int32, byte j of word c is block 4c + j
                            ex = (scales.to(tl.int32, bitcast=True) >> 23) & 0xFF
                            ex = tl.reshape(ex, (S_BLOCK // 4, 4)) << (tl.arange(0, 4) * 8)[None, :]
                            packed = tl.sum(ex, 1)
                            pc = tl.arange(0, S_BLOCK // 4)
                            num_packed: tl.constexpr = (num_scales + 3) // 4
                            tl.store(scales_out_ptr.to(tl.pointer_type(tl.int32)) + e * num_packed * per_expert
                                     + pc * per_expert + row, packed, mask=pc < num_packed)
                        else:  # column-major in the last two dimensions, as DeepEP's
                            tl.store(scales_out_ptr.to(tl.pointer_type(tl.float32)) + e * num_scales * per_expert
                                     + sc * per_expert + row, scales, mask=sc < num_scales)
                    meta = tl.load((own + meta_off + slot * 8).to(tl.pointer_type(tl.int64)))
                    tl.store(src_info_ptr + flat, (meta // NUM_TOPK).to(tl.int32))
                    tl.store(comb_slot_ptr + flat, meta)
    if last_program(state_ptr, S_DONE_RECV + seq_slot, tl.num_programs(0) * tl.num_programs(1)):
        if tl.load(state_ptr + S_FAILED, volatile=True) == 0:
            acks = (tl.load(bases_ptr + r, mask=rm, other=0) + ack_off + me * 8).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(acks, q + tl.zeros([R_BLOCK], dtype=tl.int64), mask=rm, sem="release", scope="sys")


# -- combine ----------------------------------------------------------------------------------------
@triton.jit
def combine_send_kernel(x_ptr, range_ptr, comb_slot_ptr, bases_ptr, state_ptr, fail_ptr, me, per_expert, comb_off,
                        comb_signal_off, ack_off, seq_slot, tag, timeout_ns,
                        NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, HIDDEN: tl.constexpr, W_BLOCK: tl.constexpr):
    # program (e, s): the rows local expert e received from source s back to s, each at its row
    # t * K + k there; the last program to finish writes this rank's signal word in every source
    e = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    q = tl.load(state_ptr + seq_slot) + 1
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    own = tl.load(bases_ptr + me)
    ack = (own + ack_off + r * 8).to(tl.pointer_type(tl.int64))
    wait_or_fail(ack, r == s, q - 1, device_clock_ns(), timeout_ns, r, state_ptr, fail_ptr, seq_slot, q, 0, True)
    if tl.load(state_ptr + S_FAILED, volatile=True) == 0:
        packed = tl.load(range_ptr + e * NUM_RANKS + s)
        begin = packed >> 32
        count = packed & 0xFFFFFFFF
        base = tl.load(bases_ptr + s)
        w = tl.arange(0, W_BLOCK)
        words_per_row: tl.constexpr = HIDDEN // 4
        for i in range(count):
            flat = e * per_expert + begin + i
            slot = tl.load(comb_slot_ptr + flat)
            data = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + flat * words_per_row + w, mask=w < words_per_row)
            tl.store((base + comb_off + slot * (2 * HIDDEN)).to(tl.pointer_type(tl.int64)) + w, data,
                     mask=w < words_per_row)
    if last_program(state_ptr, S_DONE_SEND + seq_slot, tl.num_programs(0) * tl.num_programs(1)):
        if tl.load(state_ptr + S_FAILED, volatile=True) == 0:
            at = (tl.load(bases_ptr + r, mask=rm, other=0) + comb_signal_off + me * 8).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(at, (q << 32) | (tag + tl.zeros([R_BLOCK], dtype=tl.int64)), mask=rm, sem="release",
                           scope="sys")
        tl.store(state_ptr + seq_slot, q)


@triton.jit
def combine_recv_kernel(bases_ptr, topk_ptr, w_ptr, dispatched_ptr, out_ptr, wait_stats_ptr, state_ptr, fail_ptr, me,
                        num_tokens, num_cols, comb_off, comb_signal_off, ack_off, seq_slot, tag, timeout_ns,
                        NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr,
                        NUM_TOPK: tl.constexpr, HAS_WAIT: tl.constexpr):
    # program t: wait for every expert rank's signal word, then out[t] = sum_k w[t, k] * row(t, k)
    # over the columns with an expert, in column order (float32, then BF16); the last program to
    # finish tells every expert rank that this parity's round was read
    t = tl.program_id(0).to(tl.int64)
    q = tl.load(state_ptr + seq_slot)
    own = tl.load(bases_ptr + me)
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    if tl.load(state_ptr + S_FAILED, volatile=True) == 0:
        signals = (own + comb_signal_off + r * 8).to(tl.pointer_type(tl.int64))
        start = device_clock_ns()
        words, late = wait_or_fail(signals, rm, q, start, timeout_ns, r, state_ptr, fail_ptr, seq_slot, q, 32, False)
        if HAS_WAIT & (t == 0):
            tl.atomic_add(wait_stats_ptr + r, tl.zeros([R_BLOCK], dtype=tl.int64) + (device_clock_ns() - start),
                          mask=rm)
        other = rm & ((words & 0xFFFFFF) != tag)  # expert ranks that combined another dispatch
        if (late == 0) & (tl.sum(other.to(tl.int32), 0) > 0):
            report(fail_ptr, F_MISMATCH, seq_slot, q, tl.min(tl.where(other, r, _BIG), 0))
        elif (late == 0) & (t < num_tokens):
            cols = tl.arange(0, H_BLOCK)
            in_row = cols < HIDDEN
            w4 = tl.arange(0, H_BLOCK // 4)
            shifts = (tl.arange(0, 4) * 16).to(tl.int64)
            acc = tl.zeros([H_BLOCK], dtype=tl.float32)
            for k in range(num_cols):
                if tl.load(topk_ptr + t * num_cols + k) >= 0:
                    if tl.load(dispatched_ptr + t * NUM_TOPK + k) != 0:
                        # the row as 8-byte words (wide loads), then its four BF16 values each
                        row = (own + comb_off + (t * NUM_TOPK + k) * (2 * HIDDEN)).to(tl.pointer_type(tl.int64))
                        data = tl.load(row + w4, mask=w4 < HIDDEN // 4, other=0)
                        halves = ((data[:, None] >> shifts[None, :]) & 0xFFFF).to(tl.uint16)
                        values = tl.reshape(halves.to(tl.bfloat16, bitcast=True), (H_BLOCK,)).to(tl.float32)
                        acc += values * tl.load(w_ptr + t * num_cols + k)
                    else:  # a row no rank sent: refuse rather than sum stale bytes
                        report(fail_ptr, F_UNMASKED, seq_slot, q, me)
            tl.store(out_ptr + t * HIDDEN + cols, acc.to(tl.bfloat16), mask=in_row)
    if last_program(state_ptr, S_DONE_RECV + seq_slot, tl.num_programs(0)):
        if tl.load(state_ptr + S_FAILED, volatile=True) == 0:
            acks = (tl.load(bases_ptr + r, mask=rm, other=0) + ack_off + me * 8).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(acks, q + tl.zeros([R_BLOCK], dtype=tl.int64), mask=rm, sem="release", scope="sys")
