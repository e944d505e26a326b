// The streamed dispatch and combine as CUDA C++, a warp group per peer (Note [Warp groups] in
// ep/kernels/stream_cuda.py, which compiles this file with NVRTC and launches it). The protocol is
// the Triton kernels' word for word: Note [Streamed dispatch] (ep/kernels/stream.py) and Note
// [Streamed combine] (ep/kernels/stream_combine.py). No #include: NVRTC compiles it alone.
// Over 400 lines: one source is one NVRTC compile and one cubin; the two kernels share the
// protocol's helpers (waits, credits, publish, the status words), which a split would duplicate.

typedef long long i64;
typedef unsigned long long u64;

#define COUNTER 16            // int64 words of a tail or head: a 128-byte line each
#define FIN (1LL << 31)       // a tail: the channel sent its last row; a head: it took it
#define COUNT_MASK ((1LL << 31) - 1)
#define W_PREVIOUS 1          // a sender: the peer has not taken the previous call's rows
#define W_CREDIT 2            // a sender: the peer's ring stayed full
#define W_ROWS 3              // a receiver: the peer sent no row
#define BAD_ROW 4             // a receiver: a row outside its source's output rows
#define W_POSTED 5            // a receiver: the host did not post the outputs (peer: this rank)
#define ABORTED (1LL << 24)   // the wait ended by the abort word, not by the deadline
#define ABORT_POLL_NS 20000   // a wait reads the abort word (maybe host memory) once an interval this long
#define MAX_GROUPS 15         // named barriers 1..15, one per warp group
#define MAX_RANKS 8           // the combine's receiver sums at most this many copies of a token at once
#ifndef UNROLL
#define UNROLL 4  // 16-byte loads a lane has in flight before its stores (8: more spills, 5-15% slower on H200)
#endif

struct alignas(16) Pair { i64 a, b; };

__device__ __forceinline__ i64 clock_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return (i64)t;
}
__device__ __forceinline__ i64 load_acquire(const i64* p) {
  i64 v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ i64 load_volatile(const i64* p) {
  i64 v;
  asm volatile("ld.volatile.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_system() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void store_relaxed(i64* p, i64 v) {
  asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// a warp group's barrier (named barrier 1 + g; 0 is __syncthreads')
__device__ __forceinline__ void group_sync(int g, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(g + 1), "r"(threads) : "memory");
}
// ring words: another GPU writes them, and a slot holds another row on the next lap, so they are
// read from L2 (.cg), never from a stale L1 line; volatile keeps them after the barrier that
// follows the tail's acquire
__device__ __forceinline__ Pair load_ring2(const Pair* p) {
  Pair v;
  asm volatile("ld.global.cg.v2.s64 {%0, %1}, [%2];" : "=l"(v.a), "=l"(v.b) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ i64 load_ring(const i64* p) {
  i64 v;
  asm volatile("ld.global.cg.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float load_ring_f(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
// the caller's tokens do not change during a call: the read-only path
__device__ __forceinline__ Pair load_input2(const Pair* p) {
  Pair v;
  asm("ld.global.nc.L1::no_allocate.v2.s64 {%0, %1}, [%2];" : "=l"(v.a), "=l"(v.b) : "l"(p));
  return v;
}
__device__ __forceinline__ void store_pair(Pair* p, Pair v) {
  asm volatile("st.global.v2.s64 [%0], {%1, %2};" ::"l"(p), "l"(v.a), "l"(v.b) : "memory");
}

// A warp copies `words` int64 words, 16 bytes a lane a step, UNROLL steps in flight (8 bytes a
// step when either end is not 16-byte aligned or the count is odd). RING: the source is a ring.
template <bool RING>
__device__ __forceinline__ void warp_copy(i64* dst, const i64* src, i64 words, int lane) {
  if (((words & 1) | (((u64)dst | (u64)src) & 15)) == 0) {
    const Pair* s = (const Pair*)src;
    Pair* d = (Pair*)dst;
    const i64 n = words >> 1;
    for (i64 base = 0; base < n; base += 32 * UNROLL) {
      Pair v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 i = base + u * 32 + lane;
        if (i < n) v[u] = RING ? load_ring2(s + i) : load_input2(s + i);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 i = base + u * 32 + lane;
        if (i < n) store_pair(d + i, v[u]);
      }
    }
  } else {
    for (i64 base = 0; base < words; base += 32 * UNROLL) {
      i64 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 i = base + u * 32 + lane;
        if (i < words) v[u] = RING ? load_ring(src + i) : src[i];
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 i = base + u * 32 + lane;
        if (i < words) dst[i] = v[u];
      }
    }
  }
}

// A bounded wait: its start, and when it next reads the abort word. The word may lie in pinned host
// memory, a PCIe round trip away; read at every poll it slows the poll, and a slow poll lengthens the
// peer's waits in turn, which can hold both ranks' calls several times slower for good. So a wait
// reads it once an interval.
struct Wait {
  i64 start, next_abort;
};

__device__ __forceinline__ Wait wait_from_now() {
  const i64 now = clock_ns();
  return {now, now + ABORT_POLL_NS};
}

// the status of a wait that has not ended: 0, or its code once past the deadline or aborted
__device__ __forceinline__ i64 ended(Wait& w, i64 timeout_ns, const i64* abort, i64 seq, int wait, int peer) {
  const i64 now = clock_ns();
  bool stop = false;
  if (now >= w.next_abort) {
    stop = load_volatile(abort) >= seq;
    w.next_abort = now + ABORT_POLL_NS;
  }
  if (!stop && now - w.start <= timeout_ns) return 0;
  return (stop ? ABORTED : 0) | ((i64)wait << 16) | (i64)peer;
}

// whether a ring may take this call's rows, given its head: one of this call, or of the previous
// call with FIN (all its rows taken), or the zero word before a first call; `took` the rows of
// this call the receiver took
__device__ __forceinline__ bool head_ready(i64 h, i64 seq, i64* took) {
  const i64 hseq = h >> 32;
  const bool fin = ((h >> 31) & 1) != 0;
  *took = hseq == seq ? (h & COUNT_MASK) : 0;
  return hseq == seq || (hseq == seq - 1 && (fin || hseq == 0));
}

// a sender's first wait: the peer took the previous call's rows of this ring; returns its status
__device__ i64 wait_previous(const i64* head, i64 seq, i64 timeout_ns, const i64* abort, int peer, i64* consumed) {
  Wait w = wait_from_now();
  while (true) {
    if (head_ready(load_acquire(head), seq, consumed)) return 0;
    const i64 code = ended(w, timeout_ns, abort, seq, W_PREVIOUS, peer);
    if (code) return code;
  }
}

__device__ __forceinline__ void publish(i64* word, i64 value) {
  fence_system();  // every thread of the group stored its rows before the barrier the caller passed
  store_relaxed(word, value);
}

// A sender leader's credits: room in the peer's ring after `sent` rows, once `want` rows would not
// fit (a head read); with none, it publishes what it sent (the rows it waits on must be visible to
// the receiver that frees the slots) and waits for a head, until its deadline. Returns the room;
// `*code` the wait's failure.
__device__ i64 credits(const i64* head, i64* tail, i64 seq, i64 sent, i64 want, i64 ring_rows, i64* consumed,
                       i64* published, i64 timeout_ns, const i64* abort, int peer, i64* code) {
  i64 room = ring_rows - (sent - *consumed), took;
  if (room < want) {
    head_ready(load_acquire(head), seq, &took);
    *consumed = took > *consumed ? took : *consumed;
    room = ring_rows - (sent - *consumed);
  }
  if (room > 0) return room;
  if (sent > *published) {
    publish(tail, (seq << 32) | sent);
    *published = sent;
  }
  Wait w = wait_from_now();
  while (room <= 0 && !*code) {
    head_ready(load_acquire(head), seq, &took);
    *consumed = took > *consumed ? took : *consumed;
    room = ring_rows - (sent - *consumed);
    if (room <= 0) *code = ended(w, timeout_ns, abort, seq, W_CREDIT, peer);
  }
  return room;
}

__device__ __forceinline__ int nth_set_bit(unsigned mask, int n) {
  for (int i = 0; i < n; ++i) mask &= mask - 1;
  return __ffs(mask) - 1;
}

struct DispatchArgs {
  const i64* rows;      // [T, R] the plan's rows (-1: not sent there)
  const i64* x;         // [T, x_words] the tokens as words
  const void* topk;     // [T, num_k] int32 or int64 (topk_bytes)
  const void* w;        // [T, num_k] weights (w_kind)
  const float* s;       // scales, strided
  const i64* bases;     // [R] every rank's stream space here
  i64* offsets;         // [R] where each source's rows start in the outputs (written from `starts` if given)
  i64* out_x;
  i64* out_idx;
  float* out_w;
  float* out_s;
  i64* status;          // [2C]
  const i64* abort;
  const i64* valid;     // 0: a refused round, send no token
  i64* seq;             // the call's seq word (with `done`: the previous call's, advanced here)
  u64* done;            // null, or a zeroed word: the launch advances the seq itself (finish)
  i64* taken;           // [R, C]
  const i64* board;     // with `padded`: the round's count board copy, row s = tag, valid, rows s sends each rank
  i64 num_tokens, max_tokens, x_words, num_k, num_scales, s_token_stride, s_col_stride, meta_words, row_words,
      ring_rows, out_rows, experts_per_rank, timeout_ns;
  i64 starts[MAX_RANKS];  // with starts_given: the offsets, by value (the host knew them: no copy to the device)
  i64 board_row, worst;   // with padded: the board's row stride and num_worst_tokens
  int me, num_ranks, channels, topk_bytes, w_kind, has_s, publish, batch, warps_per_peer, starts_given, padded, pad;
  i64 posted_tag;         // with posted: the tag the host posts this call's outputs under
  const i64* posted;      // null, or the posted outputs block in pinned memory (Posted below)
};

// Posted outputs (Note [Posted outputs] in ep/paths/planned.py): a planned fresh dispatch is
// launched right behind its count exchange, before the host has read the board and sized its
// outputs, so its senders stream while the host does; the receivers wait for the host to post the
// outputs' addresses and where each source's rows start into a block of pinned memory: words
// [tag, launched tag (the host's), x, idx, weights, scales, starts[0..R]] (starts[R]: the rows in
// all), the tag stored last. x 0: void (the host found the board bad); the receivers then take
// the rows and store none, so the senders end and the call fails on the host alone.
#define POSTED_TAG 0
#define POSTED_OUT 2
#define POSTED_STARTS 6

// where a receiver stores: the struct's outputs, or the posted ones
struct RecvOut {
  i64* x;
  i64* idx;
  float* w;
  float* s;
  const i64* starts;  // [R + 1] (a posted block's, copied to shared memory), or null: the struct's
};

// A padded round read from its board copy, by every thread alike (R x R words): whether it stands
// (the exchange accepted it and no rank receives more than `worst` rows), where each source's rows
// start here, and how many rows arrive here in all (the rest of the outputs is padding).
struct PaddedPlan {
  bool valid;
  i64 starts[MAX_RANKS + 1];
};

__device__ PaddedPlan padded_plan(const DispatchArgs& a) {
  PaddedPlan plan;
  const int R = a.num_ranks;
  bool fits = true;
  for (int d = 0; d < R; ++d) {
    i64 total = 0;
    for (int s = 0; s < R; ++s) total += a.board[s * a.board_row + 2 + d];
    fits = fits && total <= a.worst;
  }
  plan.valid = *a.valid != 0 && fits;
  plan.starts[0] = 0;
  for (int s = 0; s < R; ++s)
    plan.starts[s + 1] = plan.starts[s] + (plan.valid ? a.board[s * a.board_row + 2 + a.me] : 0);
  return plan;
}

// 16-bit floats by their bits (no cuda_fp16.h under NVRTC): half 1 is float16, 0 bfloat16
__device__ __forceinline__ float to_float(unsigned short bits, int half) {
  if (!half) return __int_as_float((int)bits << 16);
  float f;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(bits));
  return f;
}
__device__ __forceinline__ unsigned short from_float(float v, int half) {
  unsigned short h;
  if (half) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
  }
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));  // round to nearest even, as torch's cast
  return h;
}

// w_kind: 1 float32, 2 bfloat16, 3 float16
__device__ __forceinline__ float load_weight(const void* w, int kind, i64 i) {
  if (kind == 1) return ((const float*)w)[i];
  return to_float(((const unsigned short*)w)[i], kind == 3);
}

struct Groups {
  int warp, lane, g, wig, threads;
  bool leader;
};

__device__ __forceinline__ Groups groups(int warps_per_peer) {
  Groups q;
  q.warp = threadIdx.x >> 5;
  q.lane = threadIdx.x & 31;
  q.g = q.warp / warps_per_peer;
  q.wig = q.warp % warps_per_peer;
  q.threads = warps_per_peer * 32;
  q.leader = q.wig == 0 && q.lane == 0;
  return q;
}

// The program's status word (the first group's failure, else a bad row, else 0), which may lie in
// pinned host memory: the host knows a launch ended when all its words are written. With `done`
// (an advancing launch) the last program to end stores the call's seq back into the seq word, so
// that the next launch runs the next call; every program read the word before it counted itself.
__device__ void finish(i64* status, int program, i64 seq, const i64* codes, int num_groups, i64 bad, i64* seq_word,
                       u64* done) {
  __syncthreads();
  if (threadIdx.x == 0) {
    i64 code = 0;
    for (int g = 0; g < num_groups && !code; ++g) code = codes[g];
    if (done && atomicAdd(done, 1ull) == gridDim.x - 1) {
      *seq_word = seq;
      *done = 0;
    }
    status[program] = (seq << 32) | (code ? code : bad);
  }
}

// the seq of this launch: the word's (a graph's replays each run the call of their own), or with
// `done` the one after it
__device__ __forceinline__ i64 call_seq(const i64* seq_word, const u64* done) {
  return *(volatile const i64*)seq_word + (done ? 1 : 0);
}

// A row's meta parts in registers: a lane's id, weight and two scales (the first 32 ids and 64
// scales of a row; wider rows move the rest after the x copy). Both ends load them before the
// row's x: the copy's stores carry a "memory" clobber, so loads written after them would issue
// only once the stores had, a memory latency per row on top of the copy's (an FP8 row's scales,
// a column-major lane apart, most).
struct MetaRegs {
  i64 id;
  float w, s0, s1;
};

// the caller's meta parts of token `tok`
__device__ __forceinline__ MetaRegs load_meta(const DispatchArgs& a, i64 tok, int lane) {
  MetaRegs m = {0, 0.0f, 0.0f, 0.0f};
  const i64 nk = a.num_k;
  if (lane < nk) {
    const i64 i = tok * nk + lane;
    m.id = a.topk_bytes == 8 ? ((const i64*)a.topk)[i] : (i64)((const int*)a.topk)[i];
    if (a.w_kind) m.w = load_weight(a.w, a.w_kind, i);
  }
  if (a.has_s) {
    const float* s = a.s + tok * a.s_token_stride;
    if (lane < a.num_scales) m.s0 = s[lane * a.s_col_stride];
    if (lane + 32 < a.num_scales) m.s1 = s[(lane + 32) * a.s_col_stride];
  }
  return m;
}

// token `tok`'s meta parts into its ring row's meta part (ids, weights at float 2k, scales at 3k)
__device__ __forceinline__ void store_meta(const DispatchArgs& a, const MetaRegs& m, i64* meta, i64 tok, int lane) {
  const i64 nk = a.num_k;
  float* floats = (float*)meta;
  if (lane < nk) {
    meta[lane] = m.id;
    if (a.w_kind) floats[2 * nk + lane] = m.w;
  }
  for (i64 k = lane + 32; k < nk; k += 32) {
    const i64 i = tok * nk + k;
    meta[k] = a.topk_bytes == 8 ? ((const i64*)a.topk)[i] : (i64)((const int*)a.topk)[i];
    if (a.w_kind) floats[2 * nk + k] = load_weight(a.w, a.w_kind, i);
  }
  if (a.has_s) {
    if (lane < a.num_scales) floats[3 * nk + lane] = m.s0;
    if (lane + 32 < a.num_scales) floats[3 * nk + lane + 32] = m.s1;
    for (i64 k = lane + 64; k < a.num_scales; k += 32)
      floats[3 * nk + k] = a.s[tok * a.s_token_stride + k * a.s_col_stride];
  }
}

// a ring row's meta parts, as the receiver's outputs take them
__device__ __forceinline__ MetaRegs load_ring_meta(const DispatchArgs& a, const RecvOut& out, const i64* meta,
                                                   int lane) {
  MetaRegs m = {0, 0.0f, 0.0f, 0.0f};
  const i64 nk = a.num_k;
  const float* floats = (const float*)meta;
  if (out.idx && lane < nk) {
    m.id = load_ring(meta + lane);
    if (out.w) m.w = load_ring_f(floats + 2 * nk + lane);
  }
  if (a.has_s) {
    if (lane < a.num_scales) m.s0 = load_ring_f(floats + 3 * nk + lane);
    if (lane + 32 < a.num_scales) m.s1 = load_ring_f(floats + 3 * nk + lane + 32);
  }
  return m;
}

// expert id `raw` of output row `o`, column `k`, as a local expert (-1: another rank's), and its weight
__device__ __forceinline__ void store_local(const DispatchArgs& a, const RecvOut& out, i64 o, i64 k, i64 raw, float w,
                                            i64 base) {
  const i64 local = raw - base;
  const bool here = raw >= 0 && local >= 0 && local < a.experts_per_rank;
  out.idx[o * a.num_k + k] = here ? local : -1;
  if (out.w) out.w[o * a.num_k + k] = here ? w : 0.0f;
}

// Sender program c, group g: the channel's tokens to destination g, in order, into its ring
__device__ void dispatch_send(const DispatchArgs& a, int c, i64 seq, const Groups& q, i64* sh_room, i64* sh_code) {
  const int R = a.num_ranks, C = a.channels, d = q.g;
  i64* own = (i64*)a.bases[a.me];
  i64* there = (i64*)a.bases[d];
  const i64* head = own + (i64)(R * C + d * C + c) * COUNTER;
  i64* tail = there + (i64)(a.me * C + c) * COUNTER;
  i64* ring = there + (i64)2 * R * C * COUNTER + (i64)(a.me * C + c) * a.ring_rows * a.row_words;
  i64 consumed = 0, counts = 0, published = 0;
  if (q.leader) sh_code[d] = wait_previous(head, seq, a.timeout_ns, a.abort, d, &consumed);
  group_sync(d, q.threads);
  i64 code = sh_code[d];
  const bool valid = a.padded ? padded_plan(a).valid : *a.valid != 0;
  const i64 num_tokens = valid ? a.num_tokens : 0;
  const i64 per = (num_tokens + C - 1) / C;
  const i64 end = per * (c + 1) < num_tokens ? per * (c + 1) : num_tokens;
  for (i64 chunk = per * c; chunk < end && !code; chunk += 32) {
    const i64 t = chunk + q.lane;
    const i64 at = t < end ? a.rows[t * R + d] : -1;
    unsigned left = __ballot_sync(0xffffffffu, at >= 0);
    while (left) {
      if (q.leader) {  // credits for the next rows
        sh_room[d] = credits(head, tail, seq, counts, __popc(left), a.ring_rows, &consumed, &published, a.timeout_ns,
                             a.abort, d, &code);
        sh_code[d] = code;
      }
      group_sync(d, q.threads);
      code = sh_code[d];
      if (code) break;
      const i64 room = sh_room[d];
      const int n = __popc(left);
      const int m = room < n ? (int)room : n;
      for (int j = q.wig; j < m; j += a.warps_per_peer) {
        const int bit = nth_set_bit(left, j);
        const i64 tok = chunk + bit;
        const i64 ordinal = __shfl_sync(0xffffffffu, at, bit) - (i64)d * a.max_tokens;
        i64* row = ring + ((counts + j) % a.ring_rows) * a.row_words;
        const MetaRegs parts = load_meta(a, tok, q.lane);  // before the copy (MetaRegs says why)
        warp_copy<false>(row, a.x + tok * a.x_words, a.x_words, q.lane);
        i64* meta = row + a.x_words;
        store_meta(a, parts, meta, tok, q.lane);
        if (q.lane == 0) meta[a.meta_words] = ordinal;
      }
      counts += m;
      for (int j = 0; j < m; ++j) left &= left - 1;
      group_sync(d, q.threads);  // the group's rows are stored before the tail that counts them
      if (q.leader && counts - published >= a.publish) {
        publish(tail, (seq << 32) | counts);
        published = counts;
      }
    }
  }
  if (!code && q.leader) publish(tail, (seq << 32) | FIN | counts);  // also where it sent nothing
}

// Receiver program c, group g: source g's rows of this channel into the outputs, by their ordinals
__device__ void dispatch_recv(const DispatchArgs& a, const RecvOut& out, int c, i64 seq, const Groups& q, i64* sh_n,
                              i64* sh_code, i64* sh_bad) {
  const int R = a.num_ranks, C = a.channels, s = q.g;
  i64* own = (i64*)a.bases[a.me];
  const i64* tail = own + (i64)(s * C + c) * COUNTER;
  i64* head = (i64*)a.bases[s] + (i64)(R * C + a.me * C + c) * COUNTER;
  const i64* ring = own + (i64)2 * R * C * COUNTER + (i64)(s * C + c) * a.ring_rows * a.row_words;
  i64 lo, hi;
  const bool store = out.x != nullptr;  // (a void posted block: take the rows, store none)
  if (out.starts) {
    lo = store ? out.starts[s] : 0;
    hi = store ? out.starts[s + 1] : (i64)1 << 62;
  } else if (a.padded) {
    const PaddedPlan plan = padded_plan(a);
    lo = plan.starts[s];
    hi = s + 1 < R ? plan.starts[s + 1] : a.out_rows;
  } else {
    const i64* offsets = a.starts_given ? a.starts : a.offsets;
    lo = offsets[s];
    hi = s + 1 < R ? offsets[s + 1] : a.out_rows;
  }
  if ((a.starts_given || a.padded || out.starts) && c == 0 && q.leader)
    a.offsets[s] = lo;  // the handle's, for its cached calls
  const i64 base = (i64)a.me * a.experts_per_rank, nk = a.num_k;
  i64 have = 0, code = 0;
  Wait w = wait_from_now();
  while (true) {
    if (q.leader) {
      const i64 t = load_acquire(tail);
      const bool ours = (t >> 32) == seq;
      const i64 count = ours ? (t & COUNT_MASK) : 0;
      i64 n = count - have;
      n = n < 0 ? 0 : (n > a.batch ? a.batch : n);
      const bool finished = ours && ((t >> 31) & 1) && have + n == count;
      if (n == 0 && !finished) {
        code = ended(w, a.timeout_ns, a.abort, seq, W_ROWS, s);
      } else {
        w = wait_from_now();
      }
      sh_n[s] = finished ? -1 - n : n;  // (finished: -1 - n)
      sh_code[s] = code;
    }
    group_sync(s, q.threads);
    code = sh_code[s];
    if (code) break;
    const i64 word = sh_n[s];
    const bool finished = word < 0;
    const i64 n = finished ? -1 - word : word;
    for (i64 j = q.wig; j < n; j += a.warps_per_peer) {
      const i64* row = ring + ((have + j) % a.ring_rows) * a.row_words;
      const i64* meta = row + a.x_words;
      const float* floats = (const float*)meta;
      const i64 ordinal = load_ring(meta + a.meta_words);
      const MetaRegs parts = load_ring_meta(a, out, meta, q.lane);  // before the copy (MetaRegs says why)
      const i64 o = lo + ordinal;
      if (ordinal < 0 || o >= hi) {
        if (q.lane == 0) atomicCAS((u64*)sh_bad, 0ull, (u64)(((i64)BAD_ROW << 16) | s));
        continue;
      }
      if (!store) continue;
      warp_copy<true>(out.x + o * a.x_words, row, a.x_words, q.lane);
      if (out.idx) {
        if (q.lane < nk) store_local(a, out, o, q.lane, parts.id, parts.w, base);
        for (i64 k = q.lane + 32; k < nk; k += 32)
          store_local(a, out, o, k, load_ring(meta + k), out.w ? load_ring_f(floats + 2 * nk + k) : 0.0f, base);
      }
      if (a.has_s) {
        if (q.lane < a.num_scales) out.s[o * a.num_scales + q.lane] = parts.s0;
        if (q.lane + 32 < a.num_scales) out.s[o * a.num_scales + q.lane + 32] = parts.s1;
        for (i64 k = q.lane + 64; k < a.num_scales; k += 32)
          out.s[o * a.num_scales + k] = load_ring_f(floats + 3 * nk + k);
      }
    }
    have += n;
    group_sync(s, q.threads);  // every row read before its slot goes back to the source
    if (q.leader && (n > 0 || finished)) publish(head, (seq << 32) | (finished ? FIN : 0) | have);
    if (finished) break;
  }
  // the rows this channel took from the source: where the streamed combine finds what it sends back
  if (q.leader) a.taken[s * C + c] = have;
}

// A receiver program's outputs posted by the host (Posted above): thread 0 waits for the tag (until
// the deadline or the abort word; its failure then stands for every group) and copies the block
// into shared memory for the program.
__device__ void take_posted(const DispatchArgs& a, i64 seq, i64* sh_posted, i64* sh_code) {
  if (threadIdx.x == 0) {
    const i64* block = a.posted;
    Wait w = wait_from_now();
    i64 code = 0;
    while (load_acquire(block + POSTED_TAG) != a.posted_tag && !code)
      code = ended(w, a.timeout_ns, a.abort, seq, W_POSTED, a.me);
    for (int g = 0; g < a.num_ranks; ++g) sh_code[g] = code;
    for (int i = 0; i < 4 + a.num_ranks + 1; ++i) sh_posted[i] = load_volatile(block + POSTED_OUT + i);
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(768, 1) warmlink_stream_dispatch(const __grid_constant__ DispatchArgs a) {
  __shared__ i64 sh_n[MAX_GROUPS], sh_code[MAX_GROUPS], sh_bad, sh_posted[4 + MAX_RANKS + 1];
  const int C = a.channels, p = blockIdx.x;
  const i64 seq = call_seq(a.seq, a.done);
  if (threadIdx.x == 0) sh_bad = 0;
  if (threadIdx.x < MAX_GROUPS) sh_code[threadIdx.x] = 0;
  __syncthreads();
  RecvOut out = {a.out_x, a.out_idx, a.out_w, a.out_s, nullptr};
  if (a.posted && p >= C) {
    take_posted(a, seq, sh_posted, sh_code);
    out = {(i64*)sh_posted[0], (i64*)sh_posted[1], (float*)sh_posted[2], (float*)sh_posted[3], sh_posted + 4};
  }
  const Groups q = groups(a.warps_per_peer);
  if (a.padded && p >= C && a.out_idx) {  // padding rows: no expert, no weight (the receivers fill the rest)
    const i64 from = padded_plan(a).starts[a.num_ranks] * a.num_k, to = a.out_rows * a.num_k;
    for (i64 e = from + (i64)(p - C) * blockDim.x + threadIdx.x; e < to; e += (i64)C * blockDim.x) {
      a.out_idx[e] = -1;
      if (a.out_w) a.out_w[e] = 0.0f;
    }
  }
  if (q.g < a.num_ranks) {
    if (p < C) dispatch_send(a, p, seq, q, sh_n, sh_code);
    else if (!sh_code[q.g]) dispatch_recv(a, out, p - C, seq, q, sh_n, sh_code, &sh_bad);
  }
  finish(a.status, p, seq, sh_code, a.num_ranks, sh_bad, a.seq, a.done);
}

struct CombineArgs {
  const i64* rows;      // [T, R] this rank's plan rows of the dispatch (as a source)
  const i64* x;         // [N, x_words] the expert outputs, as words
  const float* w;       // [N, num_k] or null
  const i64* taken;     // [R, C] the dispatch's
  const i64* offsets;   // [R] the dispatch's recv_offset
  const i64* bases;
  void* out;            // [T, hidden] x's dtype
  float* out_w;         // [T, num_k] or null
  i64* status;
  const i64* abort;
  i64* seq;
  u64* done;
  i64 num_tokens, x_rows, x_words, num_k, row_words, ring_rows, timeout_ns;
  int me, num_ranks, channels, half, publish, batch, warps_per_peer;  // half: 1 float16, 0 bfloat16
  int merge;  // dispatch channels a combine program takes (Merged channels below)
};

// Merged channels: a combine program may take `merge` adjacent dispatch channels [k0, k1) at once,
// so that fewer programs store across NVLink (at 4 ranks 10 programs a side ran 10-25% faster than
// 20, while the dispatch ran faster on 20). A source's rings of adjacent channels are adjacent, so
// the program's ring is theirs end to end (k1 - k0 rings of rows); the first channel's head and
// tail carry its credits and counts; the others' heads get FIN at the end, as the next call's
// senders wait for. Programs past the last merged channel only finish.
struct Merged {
  int k0, k1;
  i64 ring_rows;
};
__device__ __forceinline__ Merged merged(const CombineArgs& a, int c) {
  const int k0 = c * a.merge, k1 = k0 + a.merge < a.channels ? k0 + a.merge : a.channels;
  return {k0, k1, a.ring_rows * (k1 - k0)};
}

// Sender program c at an expert rank, group g: the rows dispatch channel c took from source g,
// back into g's ring, in order
__device__ void combine_send(const CombineArgs& a, int c, i64 seq, const Groups& q, i64* sh_room, i64* sh_code) {
  const int R = a.num_ranks, C = a.channels, s = q.g;
  const Merged span = merged(a, c);
  i64* own = (i64*)a.bases[a.me];
  i64* there = (i64*)a.bases[s];
  const i64* head = own + (i64)(R * C + s * C + span.k0) * COUNTER;
  i64* tail = there + (i64)(a.me * C + span.k0) * COUNTER;
  i64* ring = there + (i64)2 * R * C * COUNTER + (i64)(a.me * C + span.k0) * a.ring_rows * a.row_words;
  i64 lo = a.offsets[s], n = 0;
  for (int k = 0; k < span.k0; ++k) lo += a.taken[s * C + k];
  for (int k = span.k0; k < span.k1; ++k) n += a.taken[s * C + k];
  i64 consumed = 0, sent = 0, published = 0;
  if (q.leader) {
    i64 code = (lo < 0 || n < 0 || lo + n > a.x_rows) ? (((i64)BAD_ROW << 16) | s) : 0;
    for (int k = span.k1 - 1; k >= span.k0 && !code; --k)  // every merged ring free of the previous call (k0's last)
      code = wait_previous(own + (i64)(R * C + s * C + k) * COUNTER, seq, a.timeout_ns, a.abort, s, &consumed);
    sh_code[s] = code;
  }
  group_sync(s, q.threads);
  i64 code = sh_code[s];
  while (sent < n && !code) {
    if (q.leader) {
      sh_room[s] = credits(head, tail, seq, sent, n - sent, span.ring_rows, &consumed, &published, a.timeout_ns,
                           a.abort, s, &code);
      sh_code[s] = code;
    }
    group_sync(s, q.threads);
    code = sh_code[s];
    if (code) break;
    i64 m = n - sent;
    m = m < sh_room[s] ? m : sh_room[s];
    m = m < a.publish ? m : a.publish;
    for (i64 j = q.wig; j < m; j += a.warps_per_peer) {
      const i64 src = lo + sent + j;
      i64* row = ring + ((sent + j) % span.ring_rows) * a.row_words;
      warp_copy<false>(row, a.x + src * a.x_words, a.x_words, q.lane);
      if (a.w)
        for (i64 k = q.lane; k < a.num_k; k += 32) ((float*)row)[2 * a.x_words + k] = a.w[src * a.num_k + k];
    }
    sent += m;
    group_sync(s, q.threads);
    if (q.leader && sent - published >= a.publish) {
      publish(tail, (seq << 32) | sent);
      published = sent;
    }
  }
  if (!code && q.leader) publish(tail, (seq << 32) | FIN | sent);
}

// A warp sums one token's copies (rows[d]: rank d's, or null), 8 elements a lane a step, in rank
// order so that the sum is the same bits every run. A step's loads are one per copy; a lane keeps
// SUM_PAIRS 16-byte loads in flight across steps (2 ranks: 4 steps, 4 ranks: 2), since each step's
// loads wait a full memory round trip and a warp has ~28 steps a 7168-wide token.
#ifndef SUM_PAIRS
#define SUM_PAIRS 8
#endif
#ifndef SUM_RANKS
#define SUM_RANKS MAX_RANKS  // the most ranks a launch has: ep/kernels/stream_cuda.py compiles one module for 2, 4, 8
#endif
template <int RANKS>
__device__ __forceinline__ void sum_token(const unsigned short* const* rows, unsigned short* out, i64 hidden, int lane,
                                          int half) {
  constexpr int STEPS = SUM_PAIRS / RANKS > 0 ? SUM_PAIRS / RANKS : 1;
  for (i64 base = lane * 8; base < hidden; base += 32 * 8 * STEPS) {
    Pair v[STEPS][RANKS];
#pragma unroll
    for (int u = 0; u < STEPS; ++u)
#pragma unroll
      for (int d = 0; d < RANKS; ++d)
        if (rows[d] && base + u * 256 < hidden) v[u][d] = load_ring2((const Pair*)(rows[d] + base + u * 256));
#pragma unroll
    for (int u = 0; u < STEPS; ++u) {
      const i64 e = base + u * 256;
      if (e < hidden) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int d = 0; d < RANKS; ++d)
          if (rows[d]) {
            const unsigned short* h = (const unsigned short*)&v[u][d];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += to_float(h[i], half);
          }
        Pair o;
        unsigned short* h = (unsigned short*)&o;
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = from_float(acc[i], half);
        store_pair((Pair*)(out + e), o);
      }
    }
  }
}

// Receiver program c at a source: its tokens of channel c in tiles of at most one token a warp
// (and a ring of rows from any rank); each token's copies summed in float32 in rank order
__device__ void combine_recv(const CombineArgs& a, int c, i64 seq, int warps, i64* sh_code, int* sh_goes,
                             i64* sh_consumed, int* sh_need) {
  const int R = a.num_ranks, C = a.channels;
  const Merged span = merged(a, c);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool poller = lane == 0 && warp < R;  // lane 0 of warp d waits for rank d's rows
  const int d_own = warp;
  i64* own = (i64*)a.bases[a.me];
  const i64 per = (a.num_tokens + C - 1) / C;  // the dispatch channels' tokens: [per k0, per k1)
  const i64 end = per * span.k1 < a.num_tokens ? per * span.k1 : a.num_tokens;
  i64 step = span.ring_rows < warps ? span.ring_rows : warps;
  step = step < 32 ? step : 32;
  const i64 hidden = a.x_words * 4, nk = a.num_k;
  i64 counts = 0, code = 0;  // (the poller's: rank d_own's tail count)
  if (threadIdx.x < R) sh_consumed[threadIdx.x] = 0;
  __syncthreads();
  for (i64 t0 = per * span.k0; t0 < end; t0 += step) {
    const i64 tile = end - t0 < step ? end - t0 : step;
    if (warp == 0) {  // which ranks each token of the tile has a copy on, and its place in their rows
      int goes = 0;
      if (lane < tile)
        for (int d = 0; d < R; ++d) goes |= (a.rows[(t0 + lane) * R + d] >= 0) << d;
      sh_goes[lane] = goes;
      for (int d = 0; d < R; ++d) {
        const unsigned m = __ballot_sync(0xffffffffu, (goes >> d) & 1);
        if (lane == 0) sh_need[d] = __popc(m);
        sh_goes[32 + lane * MAX_RANKS + (d < MAX_RANKS ? d : 0)] = __popc(m & ((1u << lane) - 1));
      }
    }
    __syncthreads();
    if (poller) {  // 1. rank d_own's rows of the tile are in its ring (a bounded wait)
      const i64* tail = own + (i64)(d_own * C + span.k0) * COUNTER;
      const i64 need = sh_need[d_own], consumed = sh_consumed[d_own];
      Wait w = wait_from_now();
      while (need > counts - consumed && !code) {
        const i64 t = load_acquire(tail);
        if ((t >> 32) == seq) counts = t & COUNT_MASK;
        if (need <= counts - consumed) break;
        if ((t >> 32) == seq && ((t >> 31) & 1)) code = ((i64)BAD_ROW << 16) | d_own;  // FIN, rows short
        else code = ended(w, a.timeout_ns, a.abort, seq, W_ROWS, d_own);
      }
      sh_code[d_own] = code;
    }
    __syncthreads();
    for (int d = 0; d < R && !code; ++d) code = sh_code[d];
    if (code) break;
    // 2. a warp a token: its copies, in rank order, from each rank's next rows
    if (warp < tile) {
      const i64 t = t0 + warp;
      const int goes = sh_goes[warp];
      const unsigned short* rows[MAX_RANKS];  // rank d's copy of the token, or null
#pragma unroll
      for (int d = 0; d < MAX_RANKS; ++d) {
        rows[d] = nullptr;
        if (d < R && ((goes >> d) & 1)) {
          const i64 slot = (sh_consumed[d] + sh_goes[32 + warp * MAX_RANKS + d]) % span.ring_rows;
          const i64* ring = own + (i64)2 * R * C * COUNTER + (i64)(d * C + span.k0) * a.ring_rows * a.row_words;
          rows[d] = (const unsigned short*)(ring + slot * a.row_words);
        }
      }
      unsigned short* out = (unsigned short*)a.out + t * hidden;
      if (((hidden & 7) | ((u64)out & 15)) == 0) {  // 8 elements a lane a step
        sum_token<SUM_RANKS>(rows, out, hidden, lane, a.half);
      } else {
        for (i64 e = lane; e < hidden; e += 32) {
          float acc = 0;
#pragma unroll
          for (int d = 0; d < MAX_RANKS; ++d)
            if (rows[d]) {
              unsigned short bits;
              asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(bits) : "l"(rows[d] + e) : "memory");
              acc += to_float(bits, a.half);
            }
          out[e] = from_float(acc, a.half);
        }
      }
      if (a.out_w)
        for (i64 k = lane; k < nk; k += 32) {
          float acc = 0;
#pragma unroll
          for (int d = 0; d < MAX_RANKS; ++d)
            if (rows[d]) acc += load_ring_f((const float*)rows[d] + 2 * a.x_words + k);
          a.out_w[t * nk + k] = acc;
        }
    }
    __syncthreads();  // 3. every copy of the tile read: credits back to each rank that sent some
    if (poller) {
      const i64 consumed = sh_consumed[d_own] + sh_need[d_own];
      sh_consumed[d_own] = consumed;
      if (sh_need[d_own] > 0)
        publish((i64*)a.bases[d_own] + (i64)(R * C + a.me * C + span.k0) * COUNTER, (seq << 32) | consumed);
    }
    __syncthreads();
  }
  // 4. every rank's FIN with no row left over: its ring and tail are read for this call
  if (poller && !code) {
    const i64* tail = own + (i64)(d_own * C + span.k0) * COUNTER;
    const i64 consumed = sh_consumed[d_own];
    Wait w = wait_from_now();
    while (!code) {
      const i64 t = load_acquire(tail);
      const bool ours = (t >> 32) == seq;
      if (ours && (t & COUNT_MASK) > consumed) {
        code = ((i64)BAD_ROW << 16) | d_own;  // more rows than this rank's tokens sent there
      } else if (ours && ((t >> 31) & 1)) {
        break;
      } else {
        code = ended(w, a.timeout_ns, a.abort, seq, W_ROWS, d_own);
      }
    }
    if (!code) {
      i64* heads = (i64*)a.bases[d_own] + (i64)(R * C + a.me * C) * COUNTER;
      for (int k = span.k1 - 1; k > span.k0; --k) publish(heads + (i64)k * COUNTER, (seq << 32) | FIN);
      publish(heads + (i64)span.k0 * COUNTER, (seq << 32) | FIN | consumed);
    }
    sh_code[d_own] = code;
  }
}

extern "C" __global__ void __launch_bounds__(768, 1) warmlink_stream_combine(const __grid_constant__ CombineArgs a) {
  __shared__ i64 sh_room[MAX_GROUPS], sh_code[MAX_GROUPS], sh_consumed[MAX_RANKS];
  __shared__ int sh_goes[32 + 32 * MAX_RANKS], sh_need[MAX_RANKS];
  const int C = a.channels, p = blockIdx.x;
  const i64 seq = call_seq(a.seq, a.done);
  if (threadIdx.x < MAX_GROUPS) sh_code[threadIdx.x] = 0;
  __syncthreads();
  const int programs = (C + a.merge - 1) / a.merge;  // a side (Merged channels)
  if (p < C) {
    const Groups q = groups(a.warps_per_peer);
    if (q.g < a.num_ranks && p < programs) combine_send(a, p, seq, q, sh_room, sh_code);
  } else if (p - C < programs) {
    combine_recv(a, p - C, seq, blockDim.x >> 5, sh_code, sh_goes, sh_consumed, sh_need);
  }
  finish(a.status, p, seq, sh_code, a.num_ranks, 0, a.seq, a.done);
}
