// The dispatch layout (ep.kernels.layout, dispatch_layout) in one block, as CUDA C++ compiled by
// NVRTC (ep/kernels/layout_cuda.py says when it runs and why one block). The same counts as the
// Triton layout kernel: tokens per rank, (token, expert) pairs per expert, ids outside
// [-1, num_experts); and is_token_in_rank. One block holds every count in shared memory, so the
// outputs need no zeroing launch before it and no atomic reaches global memory.
// No #include: NVRTC compiles it alone.

typedef long long i64;

#define MAX_BINS 4096  // ranks + experts + 1 shared counters (16 KB)
#define MAX_RANKS 64   // a token's ranks as one 64-bit mask

struct LayoutArgs {
  const void* topk;        // [T, K] int64 or int32 (topk_bytes)
  unsigned char* in_rank;  // [T, R] bool
  int* counts;             // [R] tokens per rank, [E] pairs per expert, [1] bad ids
  i64 num_tokens;
  int topk_bytes, num_k, num_experts, experts_per_rank, num_ranks, pad;
};

extern "C" __global__ void __launch_bounds__(1024, 1) warmlink_dispatch_layout(const __grid_constant__ LayoutArgs a) {
  const void* topk = a.topk;
  unsigned char* in_rank = a.in_rank;
  const i64 num_tokens = a.num_tokens;
  const int topk_bytes = a.topk_bytes, num_k = a.num_k, num_experts = a.num_experts;
  const int experts_per_rank = a.experts_per_rank, num_ranks = a.num_ranks;
  __shared__ int bins[MAX_BINS];
  const int n = num_ranks + num_experts + 1, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < n; i += blockDim.x) bins[i] = 0;
  __syncthreads();
  int* per_expert = bins + num_ranks;
  int* bad_ids = bins + num_ranks + num_experts;
  // every warp runs the same number of steps, so that its ballots see all 32 lanes
  for (i64 base = 0; base < num_tokens; base += blockDim.x) {
    const i64 t = base + threadIdx.x;
    const bool here = t < num_tokens;
    unsigned long long ranks = 0;
    int bad = 0;
    if (here)
      for (int k = 0; k < num_k; ++k) {
        const i64 i = t * num_k + k;
        const i64 id = topk_bytes == 8 ? ((const i64*)topk)[i] : (i64)((const int*)topk)[i];
        if (id >= 0 && id < num_experts) {
          ranks |= 1ull << (id / experts_per_rank);
          atomicAdd(per_expert + id, 1);
        } else if (id != -1) {
          ++bad;
        }
      }
    if (here)
      for (int r = 0; r < num_ranks; ++r) in_rank[t * num_ranks + r] = (unsigned char)((ranks >> r) & 1);
    for (int r = 0; r < num_ranks; ++r) {  // one shared atomic per warp and rank
      const int hits = __popc(__ballot_sync(0xffffffffu, (ranks >> r) & 1));
      if (lane == 0 && hits) atomicAdd(bins + r, hits);
    }
    const int bads = __reduce_add_sync(0xffffffffu, bad);
    if (lane == 0 && bads) atomicAdd(bad_ids, bads);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) a.counts[i] = bins[i];
}
