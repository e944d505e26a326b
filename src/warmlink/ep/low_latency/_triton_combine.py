"""The low-latency ``combine`` kernel: its send phase, its receive phase, and the entry point running
either or both (Note [Low-latency device path] in ep.low_latency._device; shared parts in
ep.low_latency._triton)."""

import triton
import triton.language as tl

from warmlink.ep.kernels.programs import device_clock_ns, store_release_system
from warmlink.ep.low_latency._triton import (F_MISMATCH, F_UNMASKED, NO_RANK, S_DONE_RECV, S_DONE_SEND, acknowledge,
                                             healthy, last_program, live_ranks, live_snapshot, on_live_rank, rank_live,
                                             report, symbol, wait_words)


# -- combine ----------------------------------------------------------------------------------------
@triton.jit
def combine_send(x_ptr, range_ptr, comb_slot_ptr, bases_ptr, state_ptr, fail_ptr, mask_ptr, own, me, per_expert,
                 comb_off, comb_signal_off, ack_off, seq_slot, tag, timeout_ns, q,
                 NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr, HIDDEN: tl.constexpr,
                 W_BLOCK: tl.constexpr, SHRINK: tl.constexpr, ROWS: tl.constexpr):
    # item (e, s) of each program: the rows local expert e received from source s back to s, each
    # at its row t * K + k there, ROWS rows a step (their loads before their stores: one memory
    # latency a step, not one a row); the last program to finish writes this rank's signal word
    # in every live source
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    ack = (own + ack_off + r * 8).to(tl.pointer_type(tl.int64))
    w = tl.arange(0, W_BLOCK)
    words_per_row: tl.constexpr = HIDDEN // 4
    wm = w < words_per_row
    ri = tl.arange(0, ROWS)
    for item in range(pid, LOCAL * NUM_RANKS, grid):
        e = item // NUM_RANKS + tl.zeros([], dtype=tl.int64)
        s = item % NUM_RANKS + tl.zeros([], dtype=tl.int64)
        # the item's rows (this rank's own, from its dispatch) are found before the wait for s's ack,
        # which guards only the stores into s: the two latencies overlap
        packed = tl.load(range_ptr + e * NUM_RANKS + s)
        base = tl.load(bases_ptr + s)
        wait_words(ack, r == s, q - 1, device_clock_ns(), r, state_ptr, fail_ptr, mask_ptr, seq_slot, q, timeout_ns, 0,
                   True, SHRINK)
        if healthy(state_ptr) & rank_live(mask_ptr, s, SHRINK):
            begin = packed >> 32
            count = packed & 0xFFFFFFFF
            for i0 in range(0, count, ROWS):
                i = i0 + ri
                im = i < count
                flat = e * per_expert + begin + i
                slot = tl.load(comb_slot_ptr + flat, mask=im, other=0)
                data = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + flat[:, None] * words_per_row + w[None, :],
                               mask=im[:, None] & wm[None, :])
                # rows start 16-byte aligned (the hint goes on the pointers): 16-byte stores
                dst = tl.multiple_of((base + comb_off + slot * (2 * HIDDEN)).to(tl.pointer_type(tl.int64)), 16)
                tl.store(dst[:, None] + w[None, :], data, mask=im[:, None] & wm[None, :])
    if last_program(state_ptr, S_DONE_SEND + seq_slot, grid):
        if healthy(state_ptr):
            live = live_ranks(mask_ptr, r, rm, SHRINK)
            at = tl.load(bases_ptr + r, mask=live, other=0) + comb_signal_off + me * 8
            store_release_system(at, (q << 32) | (tag + tl.zeros([R_BLOCK], dtype=tl.int64)), live)
        tl.store(state_ptr + seq_slot, q)


@triton.jit
def _token_inputs(topk_ptr, w_ptr, dispatched_ptr, tok, num_tokens, num_cols, kk, km, NUM_TOPK: tl.constexpr):
    # token tok's expert ids, weights and sent mask (the dispatch's), or none past the last token
    t = tok + tl.zeros([], dtype=tl.int64)
    m = km & ((t + tl.zeros_like(kk)) < num_tokens)  # ([K]: the interpreter refuses a mask and-ed with a scalar)
    e = tl.load(topk_ptr + t * num_cols + kk, mask=m, other=-1).to(tl.int64)
    weight = tl.load(w_ptr + t * num_cols + kk, mask=m, other=0.0)
    sent = tl.load(dispatched_ptr + t * NUM_TOPK + kk, mask=m, other=0) != 0
    return e, weight, sent


@triton.jit
def combine_recv(bases_ptr, topk_ptr, w_ptr, dispatched_ptr, out_ptr, wait_stats_ptr, state_ptr, fail_ptr, mask_ptr, own,
                 me, num_tokens, num_cols, comb_off, comb_signal_off, ack_off, seq_slot, tag, timeout_ns, q,
                 NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr, HIDDEN: tl.constexpr,
                 C_BLOCK: tl.constexpr, NUM_TOPK: tl.constexpr, K_BLOCK: tl.constexpr, HAS_WAIT: tl.constexpr,
                 SHRINK: tl.constexpr, PREFETCH: tl.constexpr):
    # wait for every live expert rank's signal word, then for each program's tokens t: out[t] =
    # sum_k w[t, k] * row(t, k) over the columns with an expert on a live rank (float32, then
    # BF16); the last program to finish tells every expert rank that this parity's round was read
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    kk = tl.arange(0, K_BLOCK)
    km = kk < num_cols
    # PREFETCH (a launch of both phases): the first token's routing is loaded before the wait and
    # each next one's before this one's sum, which hides a cold load a token (one-launch combine
    # 1 us faster on one H200); a hook's receive alone would go from 86 to 128 registers with it,
    # 1.4 us slower, so it loads each token's routing when it gets to it
    if PREFETCH:
        e, weight, sent = _token_inputs(topk_ptr, w_ptr, dispatched_ptr, pid, num_tokens, num_cols, kk, km, NUM_TOPK)
    if healthy(state_ptr):
        signals = (own + comb_signal_off + r * 8).to(tl.pointer_type(tl.int64))
        start = device_clock_ns()
        words, failed = wait_words(signals, rm, q, start, r, state_ptr, fail_ptr, mask_ptr, seq_slot, q, timeout_ns, 32,
                                   False, SHRINK)
        if HAS_WAIT & (pid == 0):
            tl.atomic_add(wait_stats_ptr + r, tl.zeros([R_BLOCK], dtype=tl.int64) + (device_clock_ns() - start),
                          mask=rm)
        # the mask read even without SHRINK (where it is all zeros): known at compile time, it let
        # ptxas give the sum below 78 registers and half its loads in flight, 1.8 us slower on one
        # H200 (kernel durations of graph replays, one rank to itself)
        live = live_snapshot(mask_ptr, r, rm, R_BLOCK, True)
        other = live & ((words & 0xFFFFFF) != tag)  # expert ranks that combined another dispatch
        if (failed == 0) & (tl.sum(other.to(tl.int32), 0) > 0):
            report(fail_ptr, F_MISMATCH, seq_slot, q, tl.min(tl.where(other, r, NO_RANK), 0))
        elif failed == 0:
            cols = tl.arange(0, C_BLOCK)
            for tok in range(pid, num_tokens, grid):
                t = tok + tl.zeros([], dtype=tl.int64)  # (a plain int in the interpreter)
                if not PREFETCH:
                    e = tl.load(topk_ptr + t * num_cols + kk, mask=km, other=-1).to(tl.int64)
                owner = tl.where(e >= 0, e // LOCAL, -1)  # (// truncates: -1 // LOCAL would be rank 0)
                on = km & on_live_rank(owner, live, r)
                if not PREFETCH:
                    sent = tl.load(dispatched_ptr + t * NUM_TOPK + kk, mask=on, other=0) != 0
                if tl.sum((on & ~sent).to(tl.int32), 0) > 0:  # a row no rank sent: refuse rather than sum stale bytes
                    report(fail_ptr, F_UNMASKED, seq_slot, q, me)
                use = on & sent
                if PREFETCH:
                    weight = tl.where(use, weight, 0.0)
                    e, next_weight, sent = _token_inputs(topk_ptr, w_ptr, dispatched_ptr, tok + grid, num_tokens,
                                                         num_cols, kk, km, NUM_TOPK)
                else:
                    weight = tl.load(w_ptr + t * num_cols + kk, mask=use, other=0.0)
                # rows start 16-byte aligned (the hint crosses no int-to-pointer cast, so it goes on the
                # pointers): every column's row is read at once, C_BLOCK values at a time, in 16-byte loads
                rows = tl.multiple_of((own + comb_off + (t * NUM_TOPK + kk) * (2 * HIDDEN)).to(
                    tl.pointer_type(tl.bfloat16)), 16)
                for c0 in range(0, HIDDEN, C_BLOCK):
                    c = c0 + cols
                    values = tl.load(rows[:, None] + c[None, :], mask=use[:, None] & (c < HIDDEN)[None, :], other=0.0)
                    acc = tl.sum(values.to(tl.float32) * weight[:, None], 0)
                    tl.store(out_ptr + t * HIDDEN + c, acc.to(tl.bfloat16), mask=c < HIDDEN)
                if PREFETCH:
                    weight = next_weight
    if last_program(state_ptr, S_DONE_RECV + seq_slot, grid, False):
        if healthy(state_ptr):
            acknowledge(bases_ptr, mask_ptr, ack_off, me, q, r, rm, SHRINK)


def _combine(x_ptr, range_ptr, comb_slot_ptr, topk_ptr, w_ptr, dispatched_ptr, out_ptr, wait_stats_ptr, per_expert,
             num_tokens, num_cols, tag, bases_ptr, state_ptr, mask_ptr, fail_ptr, own, me, comb_off, comb_signal_off,
             ack_off, timeout_ns, seq_slot,
             PHASE: tl.constexpr, NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, LOCAL: tl.constexpr,
             HIDDEN: tl.constexpr, C_BLOCK: tl.constexpr, W_BLOCK: tl.constexpr, NUM_TOPK: tl.constexpr,
             K_BLOCK: tl.constexpr, HAS_WAIT: tl.constexpr, SHRINK: tl.constexpr, ROWS: tl.constexpr):
    # the send (PHASE 1 or 3), then the receive (PHASE 2 or 3) of a combine, as _dispatch's (the
    # arguments after ``tag`` the parity's); the handle's tensors (range, comb_slot, dispatched) are
    # its dispatch's parity's, maybe not this one's
    q = tl.load(state_ptr + seq_slot)
    if PHASE % 2 == 1:  # SEND or BOTH
        q += 1
        combine_send(x_ptr, range_ptr, comb_slot_ptr, bases_ptr, state_ptr, fail_ptr, mask_ptr, own, me, per_expert,
                     comb_off, comb_signal_off, ack_off, seq_slot, tag, timeout_ns, q, NUM_RANKS, R_BLOCK, LOCAL,
                     HIDDEN, W_BLOCK, SHRINK, ROWS)
    if PHASE // 2 == 1:  # RECV or BOTH
        combine_recv(bases_ptr, topk_ptr, w_ptr, dispatched_ptr, out_ptr, wait_stats_ptr, state_ptr, fail_ptr, mask_ptr,
                     own, me, num_tokens, num_cols, comb_off, comb_signal_off, ack_off, seq_slot, tag, timeout_ns, q,
                     NUM_RANKS, R_BLOCK, LOCAL, HIDDEN, C_BLOCK, NUM_TOPK, K_BLOCK, HAS_WAIT, SHRINK, PHASE == 3)


# as the dispatch's: neither the ints a call passes nor the small ints of a parity are specialized
combine = triton.jit(_combine, repr=symbol("combine"),
                     do_not_specialize=["per_expert", "num_tokens", "num_cols", "tag", "me", "comb_off",
                                        "comb_signal_off", "ack_off", "timeout_ns", "seq_slot"])
