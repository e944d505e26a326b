// The host steps of a fresh dispatch that stand between the GPUs, compiled (warmlink._cpp builds
// this file at first use; ep/kernels/host.py says when it runs). Each replaces a few Python lines
// of torch calls and struct packing whose interpreter time the GPUs would idle through:
//   layout: get_dispatch_layout's two outputs and the NVRTC layout kernel's launch (layout.cu);
//   fresh_launch: a streamed dispatch's outputs sized from the count board in pinned memory, where
//     each source's rows start, and the prepared launch of stream.cu's dispatch, patched and sent;
//   front_launch: a fresh dispatch's call block, its count exchange's graph and the board's event
//     (the exchange lands the board in pinned memory itself: ep/paths/sm_pushes.py, Note [Board landing]);
//   fresh_accepts: whether a fresh dispatch's tensors are of the common kind that ep's argument
//     checks (ep/protocol/checks.py) pass through unchanged, so that they need not run;
//     ll_dispatch_accepts, ll_combine_accepts: the same for the low-latency calls' tensors
//     (ll_combine_output: the combine's output too, made here where the call has none;
//     ll_combine_launch: that, then the combine's prepared launch, the common eager combine;
//     ll_dispatch_launch: the dispatch's acceptance and prepared launch alike);
//   planned_front: front_launch for a kind of fresh dispatch seen before (ep/paths/planned.py), with
//     the rows, taken and recv_offset tensors made and the streamed kernel launched behind the
//     exchange, its receivers waiting for the outputs the host posts (Note [Posted outputs]);
//   post_outputs: fresh_launch's outputs for a launch of planned_front, posted instead of launched,
//     with the handle's plan read from the same board (post_void: a post of no outputs);
//   planned_padded: the same for a padded fresh dispatch, its outputs made and its stream launched too;
//   padded_stands: whether a padded round's count board, landed, stands (the checks the next call
//     makes before its own launch; the round's plan is filled later, when its handle is used);
//   wait_landed: a short spin, without the GIL, until the count exchange landed its board;
//   status_clean: how many finished streamed launches ended clean (ep/paths/launch_status.py);
//   launch_prepared: a Triton kernel's launch whose parameters Python packed once
//     (ep/kernels/launch.py, PackedLaunch), patched with a call's values: the low-latency calls';
//     it may pack another such launch with the same values, which launch_pending makes later.
// The kernels' argument structs are packed by Python (ep/kernels/stream_cuda.py, layout_cuda.py);
// here they are only patched where a call's values go (the planned calls: into a copy of a struct
// Python packed for an earlier call of the kind; tests/ep/test_planned_front.py holds the two
// equal). The driver's functions come as addresses, so nothing here links against CUDA.
// Over 400 lines: one source is one compile at first use and one cached module; the steps share
// the board's readers, the outputs' allocation and the struct patching, which a split would
// repeat in each module.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using i64 = int64_t;
using LaunchFn = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                         unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream, void** params,
                         void** extra);

// fresh_launch's first value: launched, or why not (then nothing is allocated or launched, and the
// caller reads the board in Python to raise the error: ep.wire.handle._board_matrix)
constexpr int LAUNCHED = 0, LATE = 1, OUT_OF_RANGE = 2, DRIVER_ERROR = 3;
constexpr int MAX_RANKS = 64;

at::TensorOptions on(at::ScalarType dtype, i64 device) {
  auto options = at::TensorOptions().dtype(dtype);
  return device >= 0 ? options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))) : options;
}

int launch(i64 launch_fn, i64 function, i64 grid, i64 threads, i64 stream, void* args) {
  void* params[1] = {args};
  return reinterpret_cast<LaunchFn>(launch_fn)(reinterpret_cast<void*>(function), static_cast<unsigned>(grid), 1, 1,
                                               static_cast<unsigned>(threads), 1, 1, 0,
                                               reinterpret_cast<void*>(stream), params, nullptr);
}

// Small tensors of a call carved from one allocation: each part a contiguous view starting on a
// 256-byte boundary (as the caching allocator's own blocks do). On the way to the GPUs every call
// to the allocator costs microseconds, more once the host's caches went cold between calls, and a
// view a fraction of that; the parts share one storage, which lives while any of them does.
class Carved {
 public:
  // the byte offset of a part of `elements` elements of `dtype` (call for every part, then `make`)
  i64 add(at::ScalarType dtype, i64 elements) {
    const i64 at = bytes_;
    bytes_ += (elements * static_cast<i64>(c10::elementSize(dtype)) + 255) / 256 * 256;
    return at;
  }

  void make(i64 device) { buffer_ = at::empty({bytes_}, on(at::kByte, device)); }

  // the part at byte offset `at`: a [rows, cols] tensor of dtype (cols < 0: a vector of rows)
  at::Tensor part(i64 at, at::ScalarType dtype, i64 rows, i64 cols) const {
    const i64 size = static_cast<i64>(c10::elementSize(dtype));
    const at::Tensor typed = buffer_.view(dtype);  // (a view per part: parts are few)
    if (cols < 0) return typed.as_strided({rows}, {1}, at / size);
    return typed.as_strided({rows, cols}, {cols, 1}, at / size);
  }

 private:
  i64 bytes_ = 0;
  at::Tensor buffer_;
};

// A streamed dispatch's outputs of `rows` rows, as ep/kernels/stream.py's outputs makes them: x
// [rows, x_words] int64 words; ids [rows, num_k] int64 and weights [rows, num_k] float32 where
// num_k >= 0 (weights only with `weights`); scales [rows, num_scales] float32 where num_scales > 0
// (those three Carved from one allocation). `addresses` in the kernel's order (0 for one not
// made), for its struct's output fields.
struct Outputs {
  at::Tensor x;
  py::object idx = py::none(), weights = py::none(), scales = py::none();
  uint64_t addresses[4] = {0, 0, 0, 0};

  Outputs(i64 rows, i64 x_words, i64 num_k, bool with_weights, i64 num_scales, i64 device)
      : x(at::empty({rows, x_words}, on(at::kLong, device))) {
    addresses[0] = reinterpret_cast<uint64_t>(x.data_ptr());
    const bool ids = num_k >= 0, floats = with_weights && num_k >= 0, scaled = num_scales > 0;
    if (!ids && !floats && !scaled) return;
    Carved meta;
    const i64 idx_at = ids ? meta.add(at::kLong, rows * num_k) : 0;
    const i64 weights_at = floats ? meta.add(at::kFloat, rows * num_k) : 0;
    const i64 scales_at = scaled ? meta.add(at::kFloat, rows * num_scales) : 0;
    meta.make(device);
    if (ids) idx = made(1, meta.part(idx_at, at::kLong, rows, num_k));
    if (floats) weights = made(2, meta.part(weights_at, at::kFloat, rows, num_k));
    if (scaled) scales = made(3, meta.part(scales_at, at::kFloat, rows, num_scales));
  }

 private:
  py::object made(int slot, const at::Tensor& t) {
    addresses[slot] = reinterpret_cast<uint64_t>(t.data_ptr());
    return py::cast(t);
  }
};

// layout.cu's LayoutArgs: three pointers, the token count, six ints
struct LayoutArgs {
  const void* topk;
  void* in_rank;
  void* counts;
  i64 num_tokens;
  int32_t topk_bytes, num_k, num_experts, experts_per_rank, num_ranks, pad;
};

// (error, per_rank, per_expert, in_rank, bad_ids): the counts as views of one int32 tensor
py::tuple layout(const at::Tensor& topk, i64 num_experts, i64 num_ranks, i64 device, i64 launch_fn, i64 function,
                 i64 threads, i64 stream) {
  const i64 num_tokens = topk.size(0);
  Carved parts;  // (one allocation for the two)
  const i64 counts_at = parts.add(at::kInt, num_ranks + num_experts + 1);
  const i64 in_rank_at = parts.add(at::kBool, num_tokens * num_ranks);
  parts.make(device);
  at::Tensor counts = parts.part(counts_at, at::kInt, num_ranks + num_experts + 1, -1);
  at::Tensor in_rank = parts.part(in_rank_at, at::kBool, num_tokens, num_ranks);
  LayoutArgs args{topk.data_ptr(),
                  in_rank.data_ptr(),
                  counts.data_ptr(),
                  num_tokens,
                  static_cast<int32_t>(topk.element_size()),
                  static_cast<int32_t>(topk.size(1)),
                  static_cast<int32_t>(num_experts),
                  static_cast<int32_t>(num_experts / num_ranks),
                  static_cast<int32_t>(num_ranks),
                  0};
  const int error = launch(launch_fn, function, 1, threads, stream, &args);
  return py::make_tuple(error, counts.narrow(0, 0, num_ranks), counts.narrow(0, num_ranks, num_experts), in_rank,
                        counts.narrow(0, num_ranks + num_experts, 1));
}

// Where each source's rows start in rank's outputs, read from the count board at board_addr: LAUNCHED
// (the starts are good), LATE or OUT_OF_RANGE (what fresh_launch returns for it). A refused round
// sends nothing: no rows, every start 0.
int board_starts(i64 board_addr, i64 num_ranks, i64 row_words, i64 rank, i64 max_tokens, i64 max_ranks,
                 i64 (&starts)[MAX_RANKS + 1]) {
  const volatile i64* board = reinterpret_cast<const volatile i64*>(board_addr);
  if (num_ranks > MAX_RANKS || num_ranks > max_ranks) return OUT_OF_RANGE;
  const i64 round = board[rank * row_words];
  bool valid = true;
  for (i64 s = 0; s < num_ranks; ++s) {
    const volatile i64* row = board + s * row_words;
    if (row[0] != round) return LATE;
    valid = valid && row[1] != 0;
  }
  for (i64 s = 0; s <= num_ranks; ++s) starts[s] = 0;
  if (valid) {
    for (i64 s = 0; s < num_ranks; ++s) {
      const volatile i64* row = board + s * row_words;
      for (i64 d = 0; d < num_ranks; ++d)
        if (row[2 + d] < 0 || row[2 + d] > max_tokens) return OUT_OF_RANGE;
      starts[s + 1] = starts[s] + row[2 + rank];
    }
  }
  return LAUNCHED;
}

py::list starts_list(const i64 (&starts)[MAX_RANKS + 1], i64 num_ranks) {
  py::list given;
  for (i64 s = 0; s <= num_ranks; ++s) given.append(starts[s]);
  return given;
}

// (status, starts, x, idx, weights, scales, driver error): board [R, row_words] int64 in pinned
// memory, row s source s's [round, valid, counts to each rank...]; the outputs of starts[R] rows
// (idx and weights [rows, num_k], none where num_k is -1 or without weights; scales where
// num_scales > 0); the launch's struct at args_addr, patched at out_at (4 output pointers),
// rows_at (the rows) and starts_at (each source's first row, max_ranks words)
py::tuple fresh_launch(i64 board_addr, i64 num_ranks, i64 row_words, i64 rank, i64 max_tokens, i64 x_words,
                       i64 num_k, bool weights, i64 num_scales, i64 device, i64 args_addr, i64 out_at, i64 rows_at,
                       i64 starts_at, i64 max_ranks, i64 launch_fn, i64 function, i64 grid, i64 threads, i64 stream) {
  i64 starts[MAX_RANKS + 1];
  const int read = board_starts(board_addr, num_ranks, row_words, rank, max_tokens, max_ranks, starts);
  if (read != LAUNCHED) return py::make_tuple(read, py::none());
  const i64 rows = starts[num_ranks];
  const Outputs out(rows, x_words, num_k, weights, num_scales, device);
  char* args = reinterpret_cast<char*>(args_addr);
  std::memcpy(args + out_at, out.addresses, sizeof(out.addresses));
  std::memcpy(args + rows_at, &rows, sizeof(rows));
  i64 padded_starts[MAX_RANKS] = {0};
  std::memcpy(padded_starts, starts, num_ranks * sizeof(i64));
  std::memcpy(args + starts_at, padded_starts, max_ranks * sizeof(i64));
  const int error = launch(launch_fn, function, grid, threads, stream, args);
  return py::make_tuple(error ? DRIVER_ERROR : LAUNCHED, starts_list(starts, num_ranks), py::cast(out.x), out.idx,
                        out.weights, out.scales, error);
}

// stream.cu's posted outputs block (Note [Posted outputs]): [tag, launched tag, x, idx, weights,
// scales, starts[0..R]] int64 in pinned memory
constexpr i64 POSTED_TAG = 0, POSTED_LAUNCHED = 1, POSTED_OUT = 2, POSTED_STARTS = 6;
constexpr i64 POSTED_MAX_RANKS = 8;  // (16 words: ep/paths/planned.py's POSTED_WORDS; stream.cu's MAX_RANKS)

// The outputs of the launch waiting on the block at posted_addr (addresses 0 for a void post, whose
// receivers then store nothing), its tag stored last: the receivers read the rest once they see it.
void post(i64 posted_addr, const uint64_t (&addresses)[4], const i64* starts, i64 num_ranks) {
  volatile i64* block = reinterpret_cast<volatile i64*>(posted_addr);
  for (int i = 0; i < 4; ++i) block[POSTED_OUT + i] = static_cast<i64>(addresses[i]);
  for (i64 s = 0; s <= num_ranks; ++s) block[POSTED_STARTS + s] = starts != nullptr ? starts[s] : 0;
  std::atomic_thread_fence(std::memory_order_release);
  block[POSTED_TAG] = block[POSTED_LAUNCHED];
}

// A void post for the launch waiting on the block at posted_addr: its receivers take their rows and
// store none (the host raises the call's failure itself).
void post_void(i64 posted_addr, i64 num_ranks) {
  const uint64_t none[4] = {0, 0, 0, 0};
  post(posted_addr, none, nullptr, std::min(num_ranks, POSTED_MAX_RANKS));
}

// The plan a handle keeps, from a count board that board_starts passed (every source's row of this
// round): (round, count matrix [s][d] as lists, this rank's received rows per local expert summed
// over the sources, the matrix summed over the sources as an int32 [R, R] tensor on device, copied
// from pageable memory without waiting: DeepEP's rank_prefix_matrix); None where a source refused
// its input (the Python steps raise the refusal).
py::object board_plan(i64 board_addr, i64 num_ranks, i64 row_words, i64 rank, i64 experts_per_rank, i64 device) {
  const volatile i64* board = reinterpret_cast<const volatile i64*>(board_addr);
  for (i64 s = 0; s < num_ranks; ++s)
    if (board[s * row_words + 1] == 0) return py::none();
  py::list matrix;
  std::vector<i64> per_expert(static_cast<size_t>(experts_per_rank), 0);
  at::Tensor prefix = at::empty({num_ranks, num_ranks}, at::TensorOptions().dtype(at::kInt));
  int32_t* sums = prefix.data_ptr<int32_t>();
  for (i64 s = 0; s < num_ranks; ++s) {
    const volatile i64* row = board + s * row_words;
    py::list counts;
    for (i64 d = 0; d < num_ranks; ++d) {
      counts.append(row[2 + d]);
      sums[s * num_ranks + d] = static_cast<int32_t>(row[2 + d] + (s > 0 ? sums[(s - 1) * num_ranks + d] : 0));
    }
    matrix.append(counts);
    for (i64 e = 0; e < experts_per_rank; ++e) per_expert[e] += row[2 + num_ranks + e];
  }
  py::list experts;
  for (const i64 n : per_expert) experts.append(n);
  at::Tensor on_device = device >= 0 ? prefix.to(on(at::kInt, device), /*non_blocking=*/true) : prefix;
  return py::make_tuple(board[rank * row_words], matrix, experts, on_device);
}

// (status, starts, x, idx, weights, scales, plan): fresh_launch for a launch of planned_front, which
// waits for its outputs at posted_addr: they are made and posted there instead of launched, and the
// handle's plan read from the board in the same call (board_plan). A board fresh_launch would not
// launch from (LATE, OUT_OF_RANGE) is posted void and only its status returned, as is an allocation
// that fails (which then raises).
py::tuple post_outputs(i64 board_addr, i64 num_ranks, i64 row_words, i64 rank, i64 max_tokens, i64 x_words,
                       i64 num_k, bool weights, i64 num_scales, i64 device, i64 posted_addr, i64 experts_per_rank) {
  i64 starts[MAX_RANKS + 1];
  const int read = board_starts(board_addr, num_ranks, row_words, rank, max_tokens, POSTED_MAX_RANKS, starts);
  if (read != LAUNCHED) {
    post_void(posted_addr, num_ranks);
    return py::make_tuple(read, py::none());
  }
  try {
    const Outputs out(starts[num_ranks], x_words, num_k, weights, num_scales, device);
    post(posted_addr, out.addresses, starts, num_ranks);
    return py::make_tuple(LAUNCHED, starts_list(starts, num_ranks), py::cast(out.x), out.idx, out.weights,
                          out.scales, board_plan(board_addr, num_ranks, row_words, rank, experts_per_rank, device));
  } catch (...) {
    post_void(posted_addr, num_ranks);
    throw;
  }
}

using GraphLaunchFn = int (*)(void* graph_exec, void* stream);
using EventRecordFn = int (*)(void* event, void* stream);

// The count exchange's launches after its call block: its landed words zeroed (the exchange sets
// one per source once it landed that source's board row in pinned memory: ep/paths/sm_pushes.py,
// Note [Board landing]), its graph launched on stream, the board's event recorded. (error, failed
// step): 0 none, 1 the graph's launch, 2 the event.
std::pair<int, int> front_steps(i64 graph, i64 landed_addr, i64 num_ranks, i64 event, i64 stream,
                                i64 graph_launch_fn, i64 event_record_fn) {
  std::memset(reinterpret_cast<void*>(landed_addr), 0, static_cast<size_t>(num_ranks) * sizeof(i64));
  void* on_stream = reinterpret_cast<void*>(stream);
  int error = reinterpret_cast<GraphLaunchFn>(graph_launch_fn)(reinterpret_cast<void*>(graph), on_stream);
  if (error) return {error, 1};
  error = reinterpret_cast<EventRecordFn>(event_record_fn)(reinterpret_cast<void*>(event), on_stream);
  return {error, error ? 2 : 0};
}

// (error, failed step): the call block's words written where the count exchange's graph takes them
// from (pinned memory at call_addr), then front_steps (the failed step as its).
py::tuple front_launch(const py::sequence& words, i64 call_addr, i64 graph, i64 landed_addr, i64 num_ranks,
                       i64 event, i64 stream, i64 graph_launch_fn, i64 event_record_fn) {
  i64* call = reinterpret_cast<i64*>(call_addr);
  const size_t n = words.size();
  for (size_t i = 0; i < n; ++i) call[i] = words[i].cast<i64>();
  const auto [error, step] = front_steps(graph, landed_addr, num_ranks, event, stream, graph_launch_fn,
                                         event_record_fn);
  return py::make_tuple(error, step);
}

// Whether every one of num_ranks landed words at landed_addr (pinned memory) is set, spinning for
// up to spin_ns without the GIL: the last count exchange landed its board (Note [Board landing]).
bool wait_landed(i64 landed_addr, i64 num_ranks, i64 spin_ns) {
  const volatile i64* landed = reinterpret_cast<const volatile i64*>(landed_addr);
  auto all_set = [&] {
    for (i64 s = 0; s < num_ranks; ++s)
      if (landed[s] == 0) return false;
    return true;
  };
  if (all_set()) return true;
  py::gil_scoped_release unlocked;
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  while (!all_set()) {
    if (std::chrono::steady_clock::now() > until) return false;
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the board's words are read after the landed ones
  return true;
}

// The tensor obj holds, or null (None, or anything else: the Python checks name it)
const at::Tensor* tensor(const py::handle& obj) {
  return THPVariable_Check(obj.ptr()) ? &THPVariable_Unpack(obj.ptr()) : nullptr;
}

bool on_device(const at::Tensor& t, i64 device) {
  return device < 0 ? t.device().is_cpu() : (t.is_cuda() && t.get_device() == device);
}

bool rows_of(const at::Tensor* t, i64 device, i64 rows) {
  return t != nullptr && t->dim() == 2 && on_device(*t, device) && t->size(0) == rows;
}

bool vector_of(const at::Tensor* t, i64 device, i64 length) {
  const auto dtype = t == nullptr ? at::kBool : t->scalar_type();
  return t != nullptr && t->dim() == 1 && on_device(*t, device) && t->size(0) == length && t->is_contiguous() &&
         (dtype == at::kInt || dtype == at::kLong);
}

// A plain tensor (torch.Tensor itself or a Parameter, not a subclass) of `dims` dimensions on
// `device`, contiguous: else null
const at::Tensor* plain(const py::handle& obj, i64 dims, i64 device) {
  if (!THPVariable_CheckExact(obj.ptr())) return nullptr;
  const at::Tensor* t = &THPVariable_Unpack(obj.ptr());
  return t->dim() == dims && on_device(*t, device) && t->is_contiguous() ? t : nullptr;
}

bool ids_of(const at::Tensor* t, i64 rows, i64 max_cols) {
  return t != nullptr && (t->scalar_type() == at::kLong || t->scalar_type() == at::kInt) && t->size(0) == rows &&
         t->size(1) >= 1 && t->size(1) <= max_cols;
}

// A low-latency call's statistics tensor: None, or plain [length] of `dtype`
bool stats_of(py::handle obj, at::ScalarType dtype, i64 length, i64 device) {
  if (obj.is_none()) return true;
  const at::Tensor* t = plain(obj, 1, device);
  return t != nullptr && t->scalar_type() == dtype && t->size(0) == length;
}

// Whether a low-latency call's tensors are of the kind ep/low_latency/_checks.py passes through
// unchanged (its accepts_dispatch and accepts_combine; the flags and ints are checked there):
// dispatch x BF16 [n <= max_tokens, hidden] and topk int64 or int32 [n, 1..max_topk], all plain;
// its statistics, where given, int32 [local] and int64 [ranks].
bool ll_dispatch_accepts(py::handle x, py::handle topk, py::handle cumulative, py::handle waits, i64 device,
                         i64 hidden, i64 max_tokens, i64 max_topk, i64 local, i64 ranks) {
  const at::Tensor* xt = plain(x, 2, device);
  if (xt == nullptr || xt->scalar_type() != at::kBFloat16 || xt->size(1) != hidden || xt->size(0) > max_tokens)
    return false;
  return ids_of(plain(topk, 2, device), xt->size(0), max_topk) && stats_of(cumulative, at::kInt, local, device) &&
         stats_of(waits, at::kLong, ranks, device);
}

// combine: x BF16 [local, rows, hidden], topk [tokens, cols] as the handle's and float32 weights
// alike, out None or BF16 [tokens, hidden], all plain; its statistics, where given, int64 [ranks]
bool ll_combine_accepts(py::handle x, py::handle topk, py::handle weights, py::handle out, py::handle waits,
                        i64 device, i64 local, i64 rows, i64 hidden, i64 tokens, i64 cols, i64 ranks) {
  const at::Tensor *xt = plain(x, 3, device), *kt = plain(topk, 2, device), *wt = plain(weights, 2, device);
  if (xt == nullptr || xt->scalar_type() != at::kBFloat16 || xt->size(0) != local || xt->size(1) != rows ||
      xt->size(2) != hidden)
    return false;
  if (!ids_of(kt, tokens, cols) || kt->size(1) != cols || !stats_of(waits, at::kLong, ranks, device)) return false;
  if (wt == nullptr || wt->scalar_type() != at::kFloat || wt->size(0) != tokens || wt->size(1) != cols) return false;
  if (out.is_none()) return true;
  const at::Tensor* ot = plain(out, 2, device);
  return ot != nullptr && ot->scalar_type() == at::kBFloat16 && ot->size(0) == tokens && ot->size(1) == hidden;
}

// ll_combine_accepts, then the combine's output: `out` itself, or a new BF16 [tokens, hidden] on
// the device (the caching allocator from here costs a fraction of a torch.empty from Python); None
// where the tensors are not accepted
py::object ll_combine_output(py::handle x, py::handle topk, py::handle weights, py::handle out, py::handle waits,
                             i64 device, i64 local, i64 rows, i64 hidden, i64 tokens, i64 cols, i64 ranks) {
  if (!ll_combine_accepts(x, topk, weights, out, waits, device, local, rows, hidden, tokens, cols, ranks))
    return py::none();
  if (!out.is_none()) return py::reinterpret_borrow<py::object>(out);
  return py::cast(at::empty({tokens, hidden}, on(at::kBFloat16, device)));
}

// The kind of call (never 0) when a fresh dispatch's tensors are the kind ep's checks return
// unchanged (x and its FP8 scales, topk_idx, topk_weights, get_dispatch_layout's outputs: shapes,
// dtypes, one device, every one but the scales contiguous, weights float32: a planned call passes
// them to the kernels as they are, ep/paths/planned.py), else 0: the Python checks
// then run, and accept or raise by name. num_experts < 0: the count of num_tokens_per_expert. The
// kind (ep/protocol/checks.py's KIND_*): num_experts, num_topk, the dtypes and whether weights come;
// calls of one kind pack the same launches but for their addresses, token count and scale strides.
i64 fresh_accepts(py::handle x, py::handle scales, py::handle topk, py::handle weights, py::handle per_rank,
                  py::handle in_rank, py::handle per_expert, i64 num_experts, i64 device, i64 hidden, i64 num_scales,
                  i64 max_tokens, i64 max_topk, i64 num_ranks, i64 max_experts) {
  const at::Tensor *xt = tensor(x), *st = tensor(scales), *kt = tensor(topk), *wt = tensor(weights);
  const at::Tensor *rt = tensor(per_rank), *it = tensor(in_rank), *et = tensor(per_expert);
  if (xt == nullptr || xt->dim() != 2 || !on_device(*xt, device) || !xt->is_contiguous()) return 0;
  const i64 tokens = xt->size(0);
  if (tokens > max_tokens || xt->size(1) != hidden) return 0;
  const auto dtype = xt->scalar_type();
  if (scales.is_none()) {
    if (dtype != at::kBFloat16 && dtype != at::kHalf) return 0;
  } else if (dtype != at::kFloat8_e4m3fn || !rows_of(st, device, tokens) || st->scalar_type() != at::kFloat ||
             st->size(1) != num_scales) {
    return 0;
  }
  if (!rows_of(kt, device, tokens) || !kt->is_contiguous() || kt->size(1) > max_topk ||
      (kt->scalar_type() != at::kLong && kt->scalar_type() != at::kInt))
    return 0;
  if (!weights.is_none() && (!rows_of(wt, device, tokens) || !wt->is_contiguous() ||
                             wt->size(1) != kt->size(1) || wt->scalar_type() != at::kFloat))
    return 0;
  if (et == nullptr) return 0;
  const i64 experts = num_experts < 0 ? et->numel() : num_experts;
  if (experts <= 0 || experts % num_ranks != 0 || experts > max_experts) return 0;
  if (!vector_of(rt, device, num_ranks) || !vector_of(et, device, experts)) return 0;
  if (!rows_of(it, device, tokens) || !it->is_contiguous() || it->size(1) != num_ranks || it->scalar_type() != at::kBool)
    return 0;
  const i64 x_code = dtype == at::kBFloat16 ? 1 : dtype == at::kHalf ? 2 : 3;
  return experts | kt->size(1) << 13 | i64{kt->scalar_type() == at::kLong} << 21 |
         i64{rt->scalar_type() == at::kLong} << 22 | i64{et->scalar_type() == at::kLong} << 23 |
         i64{!weights.is_none()} << 24 | x_code << 25;
}

// stream.cu's DispatchArgs as ep/kernels/stream_cuda.py packs it (_DISPATCH): 18 pointers, then
// int64 words; the fields a planned call patches into its kind's template
constexpr size_t ROWS_AT = 0, X_AT = 8, TOPK_AT = 16, WEIGHTS_AT = 24, SCALES_AT = 32, RECV_OFFSET_AT = 48,
                 OUTPUTS_AT = 56, STATUS_AT = 88, TAKEN_AT = 128, PADDED_AT = 136, TOKENS_AT = 144,
                 SCALE_STRIDES_AT = 144 + 5 * 8, POSTED_TAG_AT = 376, POSTED_AT = 384;

template <typename T>
void put(char* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}

i64 address(const at::Tensor* t) { return t == nullptr ? 0 : reinterpret_cast<i64>(t->data_ptr()); }

// A planned call's tensors (fresh_accepts took them), and the ones it makes: rows [T, R], taken
// [R, channels] and recv_offset [R] int64, Carved from one allocation.
struct Planned {
  const at::Tensor *x, *scales, *topk, *weights, *in_rank, *per_rank, *per_expert;
  at::Tensor rows, taken, recv_offset;
  i64 s_token = 0, s_col = 0;

  Planned(py::handle x_h, py::handle scales_h, py::handle topk_h, py::handle weights_h, py::handle in_rank_h,
          py::handle per_rank_h, py::handle per_expert_h, i64 num_ranks, i64 channels, i64 device)
      : x(tensor(x_h)), scales(tensor(scales_h)), topk(tensor(topk_h)), weights(tensor(weights_h)),
        in_rank(tensor(in_rank_h)), per_rank(tensor(per_rank_h)), per_expert(tensor(per_expert_h)) {
    if (x == nullptr || topk == nullptr || in_rank == nullptr || per_rank == nullptr || per_expert == nullptr)
      throw py::type_error("a planned dispatch's tensor argument is missing");
    Carved words;  // (one allocation for the three)
    const i64 rows_at = words.add(at::kLong, x->size(0) * num_ranks), taken_at = words.add(at::kLong, num_ranks * channels);
    const i64 offset_at = words.add(at::kLong, num_ranks);
    words.make(device);
    rows = words.part(rows_at, at::kLong, x->size(0), num_ranks);
    taken = words.part(taken_at, at::kLong, num_ranks, channels);
    recv_offset = words.part(offset_at, at::kLong, num_ranks, -1);
    if (scales != nullptr) s_token = scales->stride(0), s_col = scales->stride(1);
  }

  // the call block's words (ep/kernels/call_block.py's CALL_SLOTS), written at call_addr
  void write_call(i64 call_addr, i64 config, i64 board_copy) const {
    const i64 call[14] = {address(in_rank), address(topk), address(per_rank), address(per_expert), address(&rows),
                          address(x), address(weights), address(scales), s_token, s_col, x->size(0), 0, config,
                          board_copy};
    std::memcpy(reinterpret_cast<void*>(call_addr), call, sizeof(call));
  }

  // the kind's template (bytes at template_addr) copied to args with this call's fields patched in
  void pack(char* args, i64 template_addr, i64 nbytes, i64 status_addr) const {
    std::memcpy(args, reinterpret_cast<const void*>(template_addr), static_cast<size_t>(nbytes));
    put(args + ROWS_AT, address(&rows));
    put(args + X_AT, address(x));
    put(args + TOPK_AT, address(topk));
    put(args + WEIGHTS_AT, address(weights));
    put(args + SCALES_AT, address(scales));
    put(args + RECV_OFFSET_AT, address(&recv_offset));
    put(args + STATUS_AT, status_addr);
    put(args + TAKEN_AT, address(&taken));
    put(args + TOKENS_AT, x->size(0));
    put(args + SCALE_STRIDES_AT, s_token);
    put(args + SCALE_STRIDES_AT + 8, s_col);
  }
};

// (rows, taken, recv_offset, error, failed step): an unpadded fresh dispatch of a planned kind (its
// tensors accepted by fresh_accepts; ep/paths/planned.py): Planned's tensors made, the call block
// written where the count exchange's graph takes it from, the exchange's abort word lifted, then
// front_steps (its landed words zeroed, the graph launched, the board's event recorded; the failed
// step as its), then the streamed kernel's struct packed at args_addr (Planned::pack) with the next
// tag of the posted block at posted_addr and launched behind the exchange (failed step 3): its
// receivers wait for post_outputs.
py::tuple planned_front(py::handle x_h, py::handle scales_h, py::handle topk_h, py::handle weights_h,
                        py::handle in_rank_h, py::handle per_rank_h, py::handle per_expert_h, i64 config,
                        i64 num_ranks, i64 channels, i64 device, i64 call_addr, i64 abort_addr, i64 landed_addr,
                        i64 graph, i64 event, i64 stream, i64 graph_launch_fn, i64 event_record_fn,
                        i64 template_addr, i64 args_addr, i64 args_bytes, i64 status_addr, i64 posted_addr,
                        i64 launch_fn, i64 function, i64 grid, i64 threads) {
  const Planned call(x_h, scales_h, topk_h, weights_h, in_rank_h, per_rank_h, per_expert_h, num_ranks, channels,
                     device);
  call.write_call(call_addr, config, 0);
  *reinterpret_cast<volatile i64*>(abort_addr) = 0;
  const auto [error, step] = front_steps(graph, landed_addr, num_ranks, event, stream, graph_launch_fn,
                                         event_record_fn);
  if (error) return py::make_tuple(call.rows, call.taken, call.recv_offset, error, step);
  char* args = reinterpret_cast<char*>(args_addr);
  call.pack(args, template_addr, args_bytes, status_addr);
  volatile i64* block = reinterpret_cast<volatile i64*>(posted_addr);
  const i64 tag = block[POSTED_LAUNCHED] + 1;  // (a launch never posted, after a failure, keeps its tag)
  block[POSTED_LAUNCHED] = tag;
  put(args + POSTED_TAG_AT, tag);
  put(args + POSTED_AT, posted_addr);
  const int launched = launch(launch_fn, function, grid, threads, stream, args);
  return py::make_tuple(call.rows, call.taken, call.recv_offset, launched, launched ? 3 : 0);
}

// (rows, taken, recv_offset, board copy, x, idx, weights, scales, error, failed step): a padded fresh
// dispatch of a planned kind, whole: planned_front's steps with a [R, board_row] board copy made and
// named in the call block (the exchange writes the board there too), then outputs of
// num_worst_tokens rows (x_words int64 words, num_k ids and weights where num_k >= 0 and weights,
// num_scales scales where > 0), their addresses and the board copy's patched into the struct, and
// the streamed kernel launched: it takes its offsets and whether the round stands from the copy.
// The failed step: 1 the graph, 2 the event, 3 the kernel's launch.
py::tuple planned_padded(py::handle x_h, py::handle scales_h, py::handle topk_h, py::handle weights_h,
                         py::handle in_rank_h, py::handle per_rank_h, py::handle per_expert_h, i64 config,
                         i64 num_ranks, i64 channels, i64 device, i64 call_addr, i64 abort_addr, i64 landed_addr,
                         i64 graph, i64 event, i64 stream, i64 graph_launch_fn, i64 event_record_fn,
                         i64 template_addr, i64 args_addr, i64 args_bytes, i64 status_addr, i64 board_row,
                         i64 num_worst_tokens, i64 x_words, i64 num_k, bool weights, i64 num_scales, i64 launch_fn,
                         i64 function, i64 grid, i64 threads) {
  const Planned call(x_h, scales_h, topk_h, weights_h, in_rank_h, per_rank_h, per_expert_h, num_ranks, channels,
                     device);
  at::Tensor board = at::empty({num_ranks, board_row}, on(at::kLong, device));
  const Outputs out(num_worst_tokens, x_words, num_k, weights, num_scales, device);
  auto done = [&](int error, int step) {
    return py::make_tuple(call.rows, call.taken, call.recv_offset, board, out.x, out.idx, out.weights, out.scales,
                          error, step);
  };
  call.write_call(call_addr, config, reinterpret_cast<i64>(board.data_ptr()));
  *reinterpret_cast<volatile i64*>(abort_addr) = 0;
  const auto [error, step] = front_steps(graph, landed_addr, num_ranks, event, stream, graph_launch_fn,
                                         event_record_fn);
  if (error) return done(error, step);
  char* args = reinterpret_cast<char*>(args_addr);
  call.pack(args, template_addr, args_bytes, status_addr);
  std::memcpy(args + OUTPUTS_AT, out.addresses, sizeof(out.addresses));
  put(args + PADDED_AT, reinterpret_cast<i64>(board.data_ptr()));
  const int launched = launch(launch_fn, function, grid, threads, stream, args);
  return done(launched, launched ? 3 : 0);
}

// Whether the count board at board_addr ([R, row_words] int64 in pinned memory, landed) of a padded
// round stands: every source's row of this round (rank's tag), every input valid, every count in
// [0, max_tokens] and no rank receiving more than num_worst_tokens rows. Otherwise the Python steps
// read the board again and raise what is wrong (ep/wire/handle.py's plan_from_board).
bool padded_stands(i64 board_addr, i64 num_ranks, i64 row_words, i64 rank, i64 max_tokens, i64 num_worst_tokens) {
  const volatile i64* board = reinterpret_cast<const volatile i64*>(board_addr);
  if (num_ranks <= 0 || num_ranks > MAX_RANKS || rank < 0 || rank >= num_ranks) return false;
  const i64 round = board[rank * row_words];
  i64 received[MAX_RANKS] = {0};
  for (i64 s = 0; s < num_ranks; ++s) {
    const volatile i64* row = board + s * row_words;
    if (row[0] != round || row[1] == 0) return false;
    for (i64 d = 0; d < num_ranks; ++d) {
      const i64 count = row[2 + d];
      if (count < 0 || count > max_tokens) return false;
      received[d] += count;
    }
  }
  for (i64 d = 0; d < num_ranks; ++d)
    if (num_worst_tokens > 0 && received[d] > num_worst_tokens) return false;
  return true;
}

// How many of the eager status rows `slots` (in order; [row_words] int64 each from words_addr, in
// pinned memory) ended clean: every program's word set (its seq, high bits) and none with a failure
// (low bits). The first one that has not ended, or failed, stops the count (ep/paths/launch_status.py
// reads it in Python).
i64 status_clean(i64 words_addr, i64 row_words, i64 width, const py::sequence& slots) {
  const volatile i64* words = reinterpret_cast<const volatile i64*>(words_addr);
  const size_t n = slots.size();
  for (size_t i = 0; i < n; ++i) {
    const volatile i64* row = words + slots[i].cast<i64>() * row_words;
    for (i64 p = 0; p < width; ++p) {
      const i64 word = row[p];
      if (word == 0 || (word & 0xFFFFFFFF) != 0) return static_cast<i64>(i);
    }
  }
  return static_cast<i64>(n);
}

}  // namespace

// A PackedLaunch's plan (ep/kernels/launch.py: the same constants): header words (cuLaunchKernel,
// the function, threads, shared bytes, parameters, varying ones, the pending launch's grid), each
// parameter's offset, each varying one's (parameter | size << 8 | check << 16 | argument << 24),
// the packed parameters, then the pending launch's parameters (launch_prepared's `then`).
constexpr i64 PLAN_MAX_PARAMS = 48, PLAN_MAX_BYTES = 512, PLAN_PENDING_GRID = 6;
constexpr i64 PLAN_OFFSETS = 8, PLAN_VARY = PLAN_OFFSETS + PLAN_MAX_PARAMS, PLAN_BUFFER = PLAN_VARY + PLAN_MAX_PARAMS;
constexpr i64 PLAN_PENDING = PLAN_BUFFER + PLAN_MAX_BYTES / 8;
constexpr i64 CHECK_ALIGNED = 1, CHECK_INT32 = 2;

// A launch's arguments as Python passes them (a tensor gives its address, an int itself), each read
// from Python once however many plans take it
class ArgValues {
 public:
  explicit ArgValues(const py::tuple& args) : args_(args), size_(static_cast<i64>(args.size())) {}

  // the value of argument `arg` (< 64) is `value`, whatever the tuple holds there
  void set(i64 arg, i64 value) {
    values_[arg] = value;
    known_ |= uint64_t{1} << arg;
  }

  // false where there is no such argument
  bool get(i64 arg, i64* value) {
    if (arg >= size_) return false;
    if (arg < 64 && (known_ >> arg & 1)) {
      *value = values_[arg];
      return true;
    }
    const py::handle obj = args_[arg];
    const at::Tensor* t = tensor(obj);
    *value = t != nullptr ? reinterpret_cast<i64>(t->data_ptr()) : obj.cast<i64>();
    if (arg < 64) {
      values_[arg] = *value;
      known_ |= uint64_t{1} << arg;
    }
    return true;
  }

 private:
  const py::tuple& args_;
  i64 size_;
  uint64_t known_ = 0;
  i64 values_[64];
};

// The plan's parameters, with the varying ones' values from `args`, into `buffer`; false where a
// value breaks what the kernel was compiled for (an address it assumed 16-byte aligned, an int it
// took as 32 bits)
bool pack_params(const i64* plan, ArgValues& args, char* buffer) {
  std::memcpy(buffer, plan + PLAN_BUFFER, PLAN_MAX_BYTES);
  for (i64 j = 0; j < plan[5]; ++j) {
    const i64 entry = plan[PLAN_VARY + j];
    const i64 param = entry & 0xFF, size = (entry >> 8) & 0xFF, check = (entry >> 16) & 0xFF, arg = entry >> 24;
    i64 value;
    if (!args.get(arg, &value)) return false;
    if (check == CHECK_ALIGNED && value % 16 != 0) return false;
    if (check == CHECK_INT32 && (value < INT32_MIN || value > INT32_MAX)) return false;
    char* at = buffer + plan[PLAN_OFFSETS + param];
    if (size == 4) {
      const int32_t narrow = static_cast<int32_t>(value);
      std::memcpy(at, &narrow, 4);
    } else {
      std::memcpy(at, &value, 8);
    }
  }
  return true;
}

int launch_packed(const i64* plan, const char* buffer, i64 grid, i64 stream) {
  void* params[PLAN_MAX_PARAMS];
  for (i64 i = 0; i < plan[4]; ++i) params[i] = const_cast<char*>(buffer) + plan[PLAN_OFFSETS + i];
  return reinterpret_cast<LaunchFn>(plan[0])(reinterpret_cast<void*>(plan[1]), static_cast<unsigned>(grid), 1, 1,
                                             static_cast<unsigned>(plan[2]), 1, 1, static_cast<unsigned>(plan[3]),
                                             reinterpret_cast<void*>(stream), params, nullptr);
}

// -1 where a value of `args` breaks the plan, launching nothing; else cuLaunchKernel's result. Once
// launched, the plan at `then` (0: none) gets a launch of its own with the same `args` and grid
// `then_grid` packed, which launch_pending makes later: a send packs its receive hook's launch,
// whose kernel takes the same arguments, so the hook is the driver's launch alone.
int launch_with(i64 plan_addr, i64 grid, i64 stream, ArgValues& values, i64 then_addr, i64 then_grid) {
  const i64* plan = reinterpret_cast<const i64*>(plan_addr);
  if (grid < 1 || grid > INT32_MAX) return -1;
  alignas(16) char buffer[PLAN_MAX_BYTES];
  if (!pack_params(plan, values, buffer)) return -1;
  const int status = launch_packed(plan, buffer, grid, stream);
  if (then_addr != 0) {
    i64* then = reinterpret_cast<i64*>(then_addr);
    const bool packed = status == 0 && then_grid >= 1 && then_grid <= INT32_MAX &&
                        pack_params(then, values, reinterpret_cast<char*>(then + PLAN_PENDING));
    then[PLAN_PENDING_GRID] = packed ? then_grid : 0;
  }
  return status;
}

int launch_prepared(i64 plan_addr, i64 grid, i64 stream, const py::tuple& args, i64 then_addr, i64 then_grid) {
  ArgValues values(args);
  return launch_with(plan_addr, grid, stream, values, then_addr, then_grid);
}

// The common eager combine in one call: ll_combine_output's acceptance and output, then
// launch_prepared's launch of the kernel's arguments `args`, the output's address as argument
// `out_arg` (where the call passed no `out`, the tuple holds None there). None, launching nothing,
// where the tensors are not accepted (the caller's checks then name what is wrong) or a value
// breaks the plan (its launcher takes the call); raises where the driver refuses the launch.
py::object ll_combine_launch(i64 plan_addr, i64 grid, i64 stream, const py::tuple& args, i64 then_addr,
                             i64 then_grid, i64 out_arg, py::handle x, py::handle topk, py::handle weights,
                             py::handle out, py::handle waits, i64 device, i64 local, i64 rows, i64 hidden,
                             i64 tokens, i64 cols, i64 ranks) {
  py::object output = ll_combine_output(x, topk, weights, out, waits, device, local, rows, hidden, tokens, cols, ranks);
  if (output.is_none() || out_arg < 0 || out_arg >= 64) return py::none();
  ArgValues values(args);
  values.set(out_arg, reinterpret_cast<i64>(THPVariable_Unpack(output.ptr()).data_ptr()));
  const int status = launch_with(plan_addr, grid, stream, values, then_addr, then_grid);
  if (status < 0) return py::none();
  if (status > 0)
    throw std::runtime_error("ep low-latency combine: cuLaunchKernel failed with CUDA error " + std::to_string(status));
  return output;
}

// The common eager dispatch in one call: ll_dispatch_accepts, then launch_prepared. False, launching
// nothing, where the tensors are not accepted or a value breaks the plan (as ll_combine_launch).
bool ll_dispatch_launch(i64 plan_addr, i64 grid, i64 stream, const py::tuple& args, i64 then_addr, i64 then_grid,
                        py::handle x, py::handle topk, py::handle cumulative, py::handle waits, i64 device,
                        i64 hidden, i64 max_tokens, i64 max_topk, i64 local, i64 ranks) {
  if (!ll_dispatch_accepts(x, topk, cumulative, waits, device, hidden, max_tokens, max_topk, local, ranks))
    return false;
  ArgValues values(args);
  const int status = launch_with(plan_addr, grid, stream, values, then_addr, then_grid);
  if (status > 0)
    throw std::runtime_error("ep low-latency dispatch: cuLaunchKernel failed with CUDA error " +
                             std::to_string(status));
  return status == 0;
}

// The launch launch_prepared packed in this plan, made once on `stream`: -1 where none is pending
int launch_pending(i64 plan_addr, i64 stream) {
  i64* plan = reinterpret_cast<i64*>(plan_addr);
  const i64 grid = plan[PLAN_PENDING_GRID];
  if (grid == 0) return -1;
  plan[PLAN_PENDING_GRID] = 0;
  return launch_packed(plan, reinterpret_cast<const char*>(plan + PLAN_PENDING), grid, stream);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layout", &layout);
  m.def("fresh_launch", &fresh_launch);
  m.def("front_launch", &front_launch);
  m.def("fresh_accepts", &fresh_accepts);
  m.def("ll_dispatch_accepts", &ll_dispatch_accepts);
  m.def("ll_combine_accepts", &ll_combine_accepts);
  m.def("ll_combine_output", &ll_combine_output);
  m.def("planned_front", &planned_front);
  m.def("post_outputs", &post_outputs);
  m.def("post_void", &post_void);
  m.def("planned_padded", &planned_padded);
  m.def("padded_stands", &padded_stands);
  m.def("wait_landed", &wait_landed);
  m.def("status_clean", &status_clean);
  m.def("launch_prepared", &launch_prepared);
  m.def("ll_combine_launch", &ll_combine_launch);
  m.def("ll_dispatch_launch", &ll_dispatch_launch);
  m.def("launch_pending", &launch_pending);
}
