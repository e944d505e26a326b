"""The Triton kernels of low-latency mode on a GPU (ep.low_latency._device launches them).

See Note [Low-latency device path] in ep.low_latency._device. Imported only where Triton is; tests
run every kernel through Triton's interpreter on host memory, with the clock, ``cta_any`` and the
system-scope stores (inline PTX) swapped for Python ones.

This module holds what both kernels share (the state words, the waits, the mask) and the mask
buffer's kernel; ep.low_latency._triton_dispatch and ep.low_latency._triton_combine hold the two
kernels, each with a send and a receive phase (``PHASE``): a call without a hook runs both in one
launch, a call with one runs the send now and the receive in the hook. Their symbols are
C++-mangled names (``warmlink::ep::low_latency::dispatch()`` once demangled, by ``symbol``), so
that profilers, and DeepEP's kineto-based timing, which looks for ``::dispatch`` and ``::combine``,
find each under one name whatever its phase.
"""

import triton
import triton.language as tl

from warmlink.ep.kernels.programs import cta_any, device_clock_ns, store_relaxed_system

# The device state words (ep.low_latency._device.STATE_WORDS, in this order)
# (words 0-3: the sequence numbers of dispatch and combine, by parity: a kernel's ``seq_slot``)
S_FAILED = tl.constexpr(4)  # a wait timed out: every later kernel does nothing
# + seq_slot: programs of a phase that finished (the last one signals); per phase and parity, so
# that calls of the two parities may run on two streams at once
S_DONE_SEND = tl.constexpr(8)
S_DONE_RECV = tl.constexpr(12)
# Failure codes, in the pinned host word the next call reads
F_TIMEOUT = tl.constexpr(1)
F_MISMATCH = tl.constexpr(2)
F_REFUSED = tl.constexpr(3)
F_UNMASKED = tl.constexpr(4)
REFUSED_COUNT = tl.constexpr(0xFFFFFF)  # the count of a signal word whose sender refused its input
ACK_BLOCK = tl.constexpr(32)  # ack words a send program waits for at a time
NO_RANK = tl.constexpr(1 << 30)  # above every rank: tl.min over ranks that are not flagged


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
def live_ranks(mask_ptr, r, rm, SHRINK: tl.constexpr):
    # the ranks of ``rm`` not masked (DeepEP's mask buffer: 1 = masked), as this warp reads them:
    # for masks of stores and atomics; a branch takes live_snapshot. Without SHRINK no rank is ever
    # masked (the mask calls are refused), and the mask is not read: a load on every wait's path
    if not SHRINK:
        return rm
    return rm & (tl.load(mask_ptr + r, mask=rm, other=1, volatile=True) == 0)


@triton.jit
def live_snapshot(mask_ptr, r, rm, R_BLOCK: tl.constexpr, SHRINK: tl.constexpr):
    # live_ranks, one answer for the whole program (a rank any warp saw masked is masked; a barrier
    # per rank), so that every warp of it sums and sends the same rows (cta_any)
    if not SHRINK:
        return rm
    masked = tl.load(mask_ptr + r, mask=rm, other=1, volatile=True) != 0
    live = rm
    for i in tl.static_range(R_BLOCK):
        seen = cta_any(tl.sum((masked & (r == i)).to(tl.int32), 0))
        live = live & ~((r == i) & (seen != 0))
    return live


@triton.jit
def on_live_rank(owner, live, r):
    # for each column, whether its rank ``owner`` is live (``live``: a live_snapshot over ``r``)
    return tl.sum((live[None, :] & (r[None, :] == owner[:, None])).to(tl.int32), 1) > 0


@triton.jit
def rank_live(mask_ptr, rank, SHRINK: tl.constexpr):
    # one rank of live_snapshot (one barrier)
    if not SHRINK:
        return True
    return cta_any(tl.load(mask_ptr + rank, volatile=True)) == 0


@triton.jit
def behind(words, want, wanted, SHIFT: tl.constexpr, AT_LEAST: tl.constexpr):
    if AT_LEAST:
        return wanted & ((words >> SHIFT) < want)
    return wanted & ((words >> SHIFT) != want)


@triton.jit
def poll(ptrs, wanted, want, mask_ptr, r, SHIFT: tl.constexpr, AT_LEAST: tl.constexpr, ACQUIRE: tl.constexpr,
         SHRINK: tl.constexpr):
    # the words, and which wanted, unmasked ones are behind (``r``: each word's rank). Without
    # ACQUIRE, plain loads: for acks, which order no data (the stores they guard issue after the
    # wait), and which many programs read at once (atomics on a word queue up)
    if ACQUIRE:
        words = tl.atomic_add(ptrs, 0, mask=wanted, sem="acquire", scope="sys")
    else:
        words = tl.load(ptrs, mask=wanted, other=0, volatile=True)
    return words, behind(words, want, live_ranks(mask_ptr, r, wanted, SHRINK), SHIFT, AT_LEAST)


@triton.jit
def wait_words(ptrs, wanted, want, start, r, state_ptr, fail_ptr, mask_ptr, seq_slot, q, timeout_ns,
               SHIFT: tl.constexpr, AT_LEAST: tl.constexpr, SHRINK: tl.constexpr, ACQUIRE: tl.constexpr = True):
    # bounded spin until every wanted word of an unmasked rank (``r``: each word's rank), shifted
    # right by SHIFT, equals (AT_LEAST: reaches) ``want``; a rank masked meanwhile is not waited
    # for. Past the deadline: with SHRINK the late ranks are masked (DeepEP's enable_shrink); else a
    # late rank is reported and the device state marked failed (every later kernel does nothing).
    # Returns (the words, 1 if that failure happened); the ranks to read are then
    # live_snapshot(wanted), read after this returns. Every exit and branch is decided for the
    # whole program (cta_any): each warp reads the mask and the clock itself, and near the deadline
    # they disagree
    words, late = poll(ptrs, wanted, want, mask_ptr, r, SHIFT, AT_LEAST, ACQUIRE, SHRINK)
    waiting = cta_any(tl.sum(late.to(tl.int32), 0))
    while waiting != 0:
        words, late = poll(ptrs, wanted, want, mask_ptr, r, SHIFT, AT_LEAST, ACQUIRE, SHRINK)
        on_time = (device_clock_ns() - start) <= timeout_ns
        waiting = cta_any((tl.sum(late.to(tl.int32), 0) > 0) & on_time)
    failed = tl.zeros([], dtype=tl.int32)
    if cta_any(tl.sum(late.to(tl.int32), 0)) != 0:
        if SHRINK:
            tl.atomic_xchg(mask_ptr + r, tl.zeros_like(r) + 1, mask=late, sem="release", scope="gpu")
        else:
            report(fail_ptr, F_TIMEOUT, seq_slot, q, tl.min(tl.where(late, r, NO_RANK), 0))
            tl.store(state_ptr + S_FAILED, 1)
            failed += 1
    tl.debug_barrier()  # the rows this program reads next are ordered after the acquire, in every thread
    return words, failed


@triton.jit
def last_program(state_ptr, slot, total, PUBLISHES: tl.constexpr = True):
    # count this program done; 1 in the program that finished last (it resets the count for the
    # next call). With PUBLISHES (a send) its system-scope release (the signal) then follows every
    # program's earlier stores, into peers too: the barrier and the count's GPU-scope release put
    # them before the last program's acquire, and a release carries what its thread has acquired
    # (the chain DeepEP's low-latency send relies on over NVLink). No system fence a thread: on one
    # H200 it cost the dispatch's send 1 us of its 12. A receive's count orders nothing (its ack
    # carries no data: ``acknowledge``), so it is relaxed
    tl.debug_barrier()
    if PUBLISHES:
        done = tl.atomic_add(state_ptr + slot, 1, sem="acq_rel", scope="gpu")
    else:
        done = tl.atomic_add(state_ptr + slot, 1, sem="relaxed", scope="gpu")
    last = done == total - 1
    if last:
        tl.store(state_ptr + slot, 0)
    return last


@triton.jit
def healthy(state_ptr):
    # no kernel failed, one answer for the program (cta_any): another program may fail meanwhile
    return cta_any(tl.load(state_ptr + S_FAILED, volatile=True)) == 0


@triton.jit
def acknowledge(bases_ptr, mask_ptr, ack_off, at, q, r, to, SHRINK: tl.constexpr):
    # tell the live ranks of ``to`` that this rank read what they sent it in round q (their ack word
    # ``at`` of this rank). A relaxed store: the loads it acknowledges have returned before it
    # issues (their values were stored before a barrier, and a GPU issues in order; a last
    # program's count issues after its barrier), so a rank that sees it overwrites nothing unread
    tl.debug_barrier()
    live = live_ranks(mask_ptr, r, to, SHRINK)
    acks = tl.load(bases_ptr + r, mask=live, other=0) + ack_off + at * 8
    store_relaxed_system(acks, q + tl.zeros_like(acks), live)


def symbol(name: str):
    # the kernel's symbol: warmlink::ep::low_latency::<name>(), mangled as C++ would
    return lambda _: f"_ZN8warmlink2ep11low_latency{len(name)}{name}Ev"


@triton.jit
def mask_kernel(mask_ptr, out_ptr, rank, value, NUM_RANKS: tl.constexpr, R_BLOCK: tl.constexpr, OP: tl.constexpr):
    # the mask buffer's calls, on the stream (DeepEP's): OP 0 copies it into out (int32 [R]),
    # 1 sets rank's word to value, 2 zeroes it
    r = tl.arange(0, R_BLOCK)
    rm = r < NUM_RANKS
    if OP == 0:
        tl.store(out_ptr + r, tl.load(mask_ptr + r, mask=rm, volatile=True), mask=rm)
    elif OP == 1:
        tl.atomic_xchg(mask_ptr + rank, value, sem="release", scope="gpu")
    else:
        tl.atomic_xchg(mask_ptr + r, tl.zeros_like(r), mask=rm, sem="release", scope="gpu")
