// Paged attention for XLA:CPU as a typed-FFI custom call (kernels/cpu.py builds, registers and
// calls it; the contract is kernels/contract.py).
//
// Operands (all row-major, on the host):
//   q            [B, T, Hq, D] float32 (the wrapper widens q)
//   k, v         [L, N, Hkv, bs, D] float32 / bfloat16 / float16 / int8 / float8_e4m3fn: the
//                whole layer-stacked pool, read in place at `layer` through the block tables
//   k_scales,    [L, N, Hkv, bs] float16 / bfloat16 / float32 for int8 / fp8 blocks; for float
//   v_scales     blocks a 1-element float32 placeholder that is never read
//   block_tables [B, MB] int32; context_lens [B] int32; q_positions [B, T] int32
//   layer        [1] int32 (a buffer, so the model's layer scan can pass a traced index)
// Results: out [B, T, Hq, D] float32, and lse [B, T, Hq] float32, each query row's log-sum-exp of
// its scaled scores (m + log l; -inf for a row that saw nothing), with which the streamed path
// merges this output with others over disjoint spans (model/streamed_attention.py). Attributes: scale (f32, the softmax scale), splits (i64:
// context splits per sequence; 0 picks them from the thread count, see choose_splits).
//
// Work: one task per (sequence, KV head, split), handed out over XLA's intra-op thread pool
// (the FFI's ThreadPool context: as many threads as XLA uses for its own ops, from the
// machine); the calling thread is one of the workers. With splits > 1 a second round merges each
// (sequence, KV head)'s split states. The kernel body (paged_attention_cpu_body.inc) is
// compiled twice, for the build's baseline ISA and for AVX2 + FMA, and the copy the CPU runs
// is picked once at load time (__builtin_cpu_supports), so one build runs on any x86-64.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_parallel.inc"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pagedjax_cpu {

struct Problem {
  int batch, num_q, num_heads, head_dim;
  int num_layers, num_blocks, num_kv_heads, block_size;
  int max_blocks, group, layer, splits;
  float scale;
  const float* q;
  const void* k;
  const void* v;
  const void* k_scales;
  const void* v_scales;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* q_positions;
  float* out;
  float* lse;       // [B, T, Hq]
  float* part_acc;  // [B, Hkv, S, R, D]  (splits > 1 only)
  float* part_m;    // [B, Hkv, S, R]
  float* part_l;    // [B, Hkv, S, R]

  // Floats of scratch one task uses (the body's Scratch): q and acc rows, m, l, a block's
  // scores, its widened K / V scales and rows, and the per-row token counts (ints,
  // float-sized).
  int64_t work_floats() const {
    const int64_t R = int64_t(num_q) * group;
    return R * (2 * head_dim + 3 + block_size) + 2 * int64_t(block_size) * (head_dim + 1);
  }
};

namespace generic {
#define PAGEDJAX_AVX2 0
#include "paged_attention_cpu_body.inc"
#undef PAGEDJAX_AVX2
}  // namespace generic

// -DPAGEDJAX_BASELINE_ONLY builds the baseline copy alone (to test it on an AVX2 machine).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(PAGEDJAX_BASELINE_ONLY)
#define PAGEDJAX_HAVE_AVX2_COPY 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#define PAGEDJAX_AVX2 1
#include "paged_attention_cpu_body.inc"
#undef PAGEDJAX_AVX2
}  // namespace avx2
#pragma GCC pop_options
#endif

using TaskFn = generic::TaskFn;

bool use_avx2() {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

TaskFn task_for(ffi::DataType kv, ffi::DataType scale, int head_dim) {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  if (use_avx2()) return avx2::task_for(kv, scale, head_dim);
#endif
  return generic::task_for(kv, scale, head_dim);
}

void merge(const Problem& P, int b, int h) {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  if (use_avx2()) return avx2::merge_task(P, b, h);
#endif
  generic::merge_task(P, b, h);
}

// parallel_for: cpu_parallel.inc.

// Splits per sequence when the caller leaves it to the kernel: enough tasks for about two per
// thread (tasks differ in length; the spare ones even out the tail), but no split shorter
// than kMinSplitTokens (a split's state is written and merged) and none past the blocks the
// longest sequence sees.
constexpr int kMinSplitTokens = 256;

int choose_splits(int64_t threads, int64_t pairs, int max_seen, int block_size, int max_blocks) {
  const int64_t wanted = (2 * std::max<int64_t>(1, threads) + pairs - 1) / pairs;
  const int64_t visible = std::min<int64_t>(max_blocks, (max_seen + block_size - 1) / block_size);
  const int64_t by_length = std::max<int64_t>(1, int64_t(max_seen) / kMinSplitTokens);
  return int(std::max<int64_t>(1, std::min({wanted, by_length, visible})));
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> context_lens,
                          ffi::Buffer<ffi::S32> q_positions, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                          float scale, int64_t splits) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: q must be [B, T, Hq, D], k/v "
                                       "[L, N, Hkv, bs, D], block_tables [B, MB], layer [1]");
  }
  if (k.element_type() != v.element_type()) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: k and v dtypes differ");
  }
  Problem P{};
  P.batch = int(qd[0]), P.num_q = int(qd[1]), P.num_heads = int(qd[2]), P.head_dim = int(qd[3]);
  P.num_layers = int(kd[0]), P.num_blocks = int(kd[1]), P.num_kv_heads = int(kd[2]);
  P.block_size = int(kd[3]), P.max_blocks = int(td[1]);
  if (kd[4] != qd[3] || P.head_dim < 1 || P.num_kv_heads < 1 || P.num_heads % P.num_kv_heads) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: head_dim or head counts mismatch");
  }
  P.group = P.num_heads / P.num_kv_heads;
  P.layer = layer.typed_data()[0];
  if (P.layer < 0 || P.layer >= P.num_layers) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: layer " + std::to_string(P.layer) +
                                       " is outside the pool's " +
                                       std::to_string(P.num_layers) + " layers");
  }
  const TaskFn task = task_for(k.element_type(), k_scales.element_type(), P.head_dim);
  if (task == nullptr) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: unsupported block/scale dtypes");
  }
  // The wrapper has checked the contract (kernels/contract.py); these guard the raw reads.
  const bool quantized = k.element_type() == ffi::DataType::S8 ||
                         k.element_type() == ffi::DataType::F8E4M3FN;
  const size_t token_rows = k.element_count() / size_t(P.head_dim);
  if (td[0] != qd[0] || context_lens.element_count() != size_t(qd[0]) ||
      q_positions.element_count() != size_t(qd[0] * qd[1]) ||
      (quantized && (k_scales.element_count() != token_rows ||
                     v_scales.element_count() != token_rows))) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: operand shapes disagree (B, T, or "
                                       "one scale per token and KV head)");
  }
  P.scale = scale;
  P.q = q.typed_data();
  P.k = k.untyped_data(), P.v = v.untyped_data();
  P.k_scales = k_scales.untyped_data(), P.v_scales = v_scales.untyped_data();
  P.block_tables = block_tables.typed_data();
  P.context_lens = context_lens.typed_data();
  P.q_positions = q_positions.typed_data();
  P.out = out->typed_data();
  P.lse = lse->typed_data();
  if (lse->element_count() != size_t(qd[0] * qd[1] * qd[2])) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: lse must be [B, T, Hq]");
  }

  // The blocks any query sees, checked against the pool before a task reads one.
  int max_seen = 0;
  for (int b = 0; b < P.batch; ++b) {
    int seen = 0;
    for (int t = 0; t < P.num_q; ++t) {
      const int pos = P.q_positions[int64_t(b) * P.num_q + t];
      seen = std::max(seen, std::max(0, std::min(pos + 1, P.context_lens[b])));
    }
    max_seen = std::max(max_seen, seen);
    const int visible = std::min(P.max_blocks, (seen + P.block_size - 1) / P.block_size);
    for (int i = 0; i < visible; ++i) {
      const int32_t phys = P.block_tables[int64_t(b) * P.max_blocks + i];
      if (phys < 0 || phys >= P.num_blocks) {
        return ffi::Error::InvalidArgument(
            "paged_attention_cpu: block_tables[" + std::to_string(b) + ", " + std::to_string(i) +
            "] = " + std::to_string(phys) + " is outside the pool's " +
            std::to_string(P.num_blocks) + " blocks");
      }
    }
  }

  const int64_t pairs = int64_t(P.batch) * P.num_kv_heads;
  if (pairs == 0) return ffi::Error::Success();
  P.splits = splits > 0 ? int(splits)
                        : choose_splits(pool.num_threads(), pairs, max_seen, P.block_size,
                                        P.max_blocks);
  std::vector<float> parts;
  if (P.splits > 1) {
    const int64_t states = pairs * P.splits * P.num_q * P.group;
    parts.resize(states * (P.head_dim + 2));
    P.part_acc = parts.data();
    P.part_m = P.part_acc + states * P.head_dim;
    P.part_l = P.part_m + states;
  }
  const int64_t work_floats = P.work_floats();
  parallel_for(pool, pairs * P.splits, [&](int64_t i) {
    thread_local std::vector<float> work;
    if (int64_t(work.size()) < work_floats) work.resize(work_floats);
    const int c = int(i % P.splits);
    const int64_t pair = i / P.splits;
    task(P, int(pair / P.num_kv_heads), int(pair % P.num_kv_heads), c, work.data());
  });
  if (P.splits > 1) {
    parallel_for(pool, pairs, [&](int64_t pair) {
      merge(P, int(pair / P.num_kv_heads), int(pair % P.num_kv_heads));
    });
  }
  return ffi::Error::Success();
}

}  // namespace pagedjax_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpu, pagedjax_cpu::PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // k_scales
                                  .Arg<ffi::AnyBuffer>()         // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("splits"));

// Which copy of the kernel body this CPU runs (kernels/cpu.py reports it): 1 for AVX2 + FMA.
extern "C" int PagedAttentionCpuUsesAvx2() { return pagedjax_cpu::use_avx2() ? 1 : 0; }
