// Linear layers for XLA:CPU as a typed-FFI custom call (kernels/linear_cpu.py builds, registers
// and calls it): y[M, N] = x[M, K] @ W, float32, W read in place either as [K, N] (a Dense
// kernel, [in, out]) or as [N, K] (attribute transposed = 1: a tied embedding as the output
// head, x @ E^T, with no transposed copy), or from a packed copy of a [K, N] kernel (w 3-D:
// [ceil(N / kStrip), K, kStrip], made once by linear_cpu.py pack; N is y's).
//
// LinearMultiCpu is the same for several Dense kernels of one x (q/k/v, gate/up): every output's
// tasks handed out together, one dispatch of the pool per call.
//
// Work: with W [K, N] and 1-2 rows, W's rows in fixed ranges of kStreamK, one task each, streamed
// whole into partial sums that are then added in range order. Otherwise y's columns are cut into
// blocks, one task per block, handed out over XLA's intra-op
// thread pool (the FFI's ThreadPool context, as the attention kernel does); the calling thread is
// one of the workers. Blocks are a multiple of the widest register tile, about four per thread
// so uneven tasks even out, and no smaller than kMinBlockColumns. The body
// (linear_cpu_body.inc) is compiled for the baseline ISA, for AVX2 + FMA and for AVX-512 (whose
// packed path alone runs); the copy this CPU runs is picked once at load time.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_parallel.inc"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pagedjax_cpu {

namespace generic {
#define PAGEDJAX_AVX2 0
#define PAGEDJAX_AVX512 0
#include "linear_cpu_body.inc"
#undef PAGEDJAX_AVX512
#undef PAGEDJAX_AVX2
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(PAGEDJAX_BASELINE_ONLY)
#define PAGEDJAX_HAVE_AVX2_COPY 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#define PAGEDJAX_AVX2 1
#define PAGEDJAX_AVX512 0
#include "linear_cpu_body.inc"
#undef PAGEDJAX_AVX512
#undef PAGEDJAX_AVX2
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
#define PAGEDJAX_AVX2 1
#define PAGEDJAX_AVX512 1
#include "linear_cpu_body.inc"
#undef PAGEDJAX_AVX512
#undef PAGEDJAX_AVX2
}  // namespace avx512
#pragma GCC pop_options
#endif

// The copy of the body this process runs: 0 baseline, 1 AVX2 + FMA, 2 AVX-512 for packed W
// (AVX2 elsewhere). The best the CPU has, picked at load time; LinearCpuUseIsa lowers it (tests
// and benchmarks run every copy in one process).
int best_isa() {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  static const int best = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 0
                          : __builtin_cpu_supports("avx512f") ? 2 : 1;
  return best;
#else
  return 0;
#endif
}

int& isa_in_use() {
  static int isa = best_isa();
  return isa;
}

bool linear_uses_avx2() { return isa_in_use() >= 1; }

using ColumnsFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*,
                           int64_t, int64_t);

ColumnsFn stream_for() {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  if (linear_uses_avx2()) return avx2::stream_kn;
#endif
  return generic::stream_kn;
}

ColumnsFn columns_for(bool transposed) {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  if (linear_uses_avx2()) return transposed ? avx2::columns_nk : avx2::columns_kn;
#endif
  return transposed ? generic::columns_nk : generic::columns_kn;
}

ColumnsFn packed_for() {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  if (isa_in_use() == 2) return avx512::columns_packed;
  if (isa_in_use() == 1) return avx2::columns_packed;
#endif
  return generic::columns_packed;
}

// The packed layout's strip width for the copy in use (8; AVX-512: 16).
int64_t packed_strip() {
#ifdef PAGEDJAX_HAVE_AVX2_COPY
  if (isa_in_use() == 2) return avx512::kStrip;
#endif
  return generic::kStrip;
}

constexpr int64_t kMinBlockColumns = 32;
// W [K, N] with at most kStreamMaxRows rows of x: tasks of kStreamK rows of W each (a fixed
// count, so the order of the sums does not depend on the threads), streamed whole.
constexpr int64_t kStreamMaxRows = 2;
constexpr int64_t kStreamK = 32;

// Columns per task: a multiple of 64 (the widest tile) when there are enough columns, else of
// 16, about four tasks per thread, at least kMinBlockColumns.
int64_t block_columns(int64_t n, int64_t threads) {
  const int64_t tasks = 4 * std::max<int64_t>(1, threads);
  int64_t cols = (n + tasks - 1) / tasks;
  const int64_t quantum = cols >= 64 ? 64 : 16;
  cols = (cols + quantum - 1) / quantum * quantum;
  return std::max(kMinBlockColumns, cols);
}

// One output of a call with W [K, N]: y [M, n] = x [M, K] @ w [K, n].
struct Output {
  const float* w;
  int64_t n;
  float* y;
};

// y = x @ w for every output, all their tasks handed out over the pool together (one dispatch of
// the pool's threads however many outputs), each output computed exactly as alone: the split of
// the work changes no element's order of sums.
void linear_kn(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K,
               const std::vector<Output>& outs) {
  const int64_t threads = pool.num_threads();
  if (M <= kStreamMaxRows && K > kStreamK) {
    // Each task's sums over its kStreamK rows of one W, then every y = its sums in range order.
    const ColumnsFn stream = stream_for();
    const int64_t ranges = (K + kStreamK - 1) / kStreamK;
    std::vector<int64_t> first(outs.size() + 1, 0);  // where each output's elements begin
    for (size_t j = 0; j < outs.size(); ++j) first[j + 1] = first[j] + M * outs[j].n;
    const int64_t elements = first.back();
    std::vector<float> parts(size_t(ranges * elements));  // [ranges, elements]
    parallel_for(pool, int64_t(outs.size()) * ranges, [&](int64_t t) {
      const size_t j = size_t(t / ranges);
      const int64_t r = t % ranges;
      stream(xp, M, K, outs[j].w, outs[j].n, parts.data() + r * elements + first[j],
             r * kStreamK, std::min(K, (r + 1) * kStreamK));
    });
    const int64_t cols = block_columns(elements, threads);
    parallel_for(pool, (elements + cols - 1) / cols, [&](int64_t i) {
      const int64_t e0 = i * cols, e1 = std::min(elements, (i + 1) * cols);
      for (size_t j = 0; j < outs.size(); ++j) {
        for (int64_t e = std::max(e0, first[j]); e < std::min(e1, first[j + 1]); ++e) {
          float s = parts[e];
          for (int64_t r = 1; r < ranges; ++r) s += parts[r * elements + e];
          outs[j].y[e - first[j]] = s;
        }
      }
    });
    return;
  }
  // Column blocks of every output, sized on the outputs' columns together.
  int64_t total = 0;
  for (const Output& o : outs) total += o.n;
  const int64_t cols = block_columns(total, threads);
  struct Block {
    size_t out;
    int64_t n0, n1;
  };
  std::vector<Block> blocks;
  for (size_t j = 0; j < outs.size(); ++j) {
    for (int64_t n0 = 0; n0 < outs[j].n; n0 += cols) {
      blocks.push_back({j, n0, std::min(outs[j].n, n0 + cols)});
    }
  }
  const ColumnsFn columns = columns_for(false);
  parallel_for(pool, int64_t(blocks.size()), [&](int64_t i) {
    const Block& b = blocks[size_t(i)];
    const Output& o = outs[b.out];
    columns(xp, M, K, o.w, o.n, o.y, b.n0, b.n1);
  });
}

ffi::Error shape_error(int64_t M, int64_t K, ffi::AnyBuffer::Dimensions wd, int64_t transposed,
                       ffi::AnyBuffer::Dimensions yd) {
  return ffi::Error::InvalidArgument(
      "linear_cpu: shapes disagree: x [" + std::to_string(M) + ", " + std::to_string(K) +
      "], w [" + std::to_string(wd[0]) + ", " + std::to_string(wd[1]) + "] (transposed=" +
      std::to_string(transposed) + "), y [" + std::to_string(yd[0]) + ", " +
      std::to_string(yd[1]) + "]");
}

// W packed ([ceil(N / kStrip), K, kStrip], linear_cpu.py pack): y's columns in blocks over the
// pool, as for W [K, N] in place.
ffi::Error LinearPacked(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K,
                        ffi::AnyBuffer::Dimensions wd, int64_t transposed, const float* wp,
                        ffi::AnyBuffer::Dimensions yd, float* out) {
  const int64_t N = yd[1], kStrip = packed_strip();
  if (transposed || wd[0] != (N + kStrip - 1) / kStrip || wd[1] != K || wd[2] != kStrip ||
      yd[0] != M) {
    return ffi::Error::InvalidArgument(
        "linear_cpu: packed w [" + std::to_string(wd[0]) + ", " + std::to_string(wd[1]) + ", " +
        std::to_string(wd[2]) + "] (transposed=" + std::to_string(transposed) +
        ") does not give y [" + std::to_string(yd[0]) + ", " + std::to_string(N) + "] from x [" +
        std::to_string(M) + ", " + std::to_string(K) + "]: it must be [ceil(N / " +
        std::to_string(kStrip) + "), K, " + std::to_string(kStrip) + "], transposed=0");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out, 0, sizeof(float) * size_t(M) * size_t(N));
    return ffi::Error::Success();
  }
  const ColumnsFn columns = packed_for();
  const int64_t cols = block_columns(N, pool.num_threads());  // a multiple of either strip width
  parallel_for(pool, (N + cols - 1) / cols, [&](int64_t i) {
    columns(xp, M, K, wp, N, out, i * cols, std::min(N, (i + 1) * cols));
  });
  return ffi::Error::Success();
}

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y, int64_t transposed) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() == 2 && wd.size() == 3 && yd.size() == 2) {
    return LinearPacked(pool, x.typed_data(), xd[0], xd[1], wd, transposed, w.typed_data(), yd,
                        y->typed_data());
  }
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "linear_cpu: x and y must be 2-D, w 2-D (or 3-D: packed)");
  }
  const int64_t M = xd[0], K = xd[1];
  const int64_t N = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != K || yd[0] != M || yd[1] != N) {
    return shape_error(M, K, wd, transposed, yd);
  }
  float* out = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out, 0, sizeof(float) * size_t(M) * size_t(N));
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  if (!transposed) {
    linear_kn(pool, xp, M, K, {Output{wp, N, out}});
    return ffi::Error::Success();
  }
  const ColumnsFn columns = columns_for(true);
  const int64_t cols = block_columns(N, pool.num_threads());
  parallel_for(pool, (N + cols - 1) / cols, [&](int64_t i) {
    columns(xp, M, K, wp, N, out, i * cols, std::min(N, (i + 1) * cols));
  });
  return ffi::Error::Success();
}

// Several Dense kernels of one input in one call: y_j = x @ W_j for W_j [K, N_j] (q/k/v, or
// gate/up), each W_j read in place; results equal to one Linear call per W_j, bit for bit.
ffi::Error LinearMulti(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                       ffi::RemainingRets ys) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("linear_cpu: x must be 2-D");
  if (ws.size() != ys.size() || ws.size() == 0) {
    return ffi::Error::InvalidArgument("linear_cpu: as many outputs as weights, at least one");
  }
  const int64_t M = xd[0], K = xd[1];
  std::vector<Output> outs;
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(j);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("linear_cpu: weights and outputs must be float32");
    }
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || yd.size() != 2) {
      return ffi::Error::InvalidArgument("linear_cpu: w and y must be 2-D");
    }
    if (wd[0] != K || yd[0] != M || yd[1] != wd[1]) return shape_error(M, K, wd, 0, yd);
    if (M > 0 && wd[1] > 0 && K == 0) {
      std::memset((*y)->typed_data(), 0, sizeof(float) * size_t(M) * size_t(wd[1]));
    } else if (M > 0 && wd[1] > 0) {
      outs.push_back(Output{w->typed_data(), wd[1], (*y)->typed_data()});
    }
  }
  if (!outs.empty()) linear_kn(pool, x.typed_data(), M, K, outs);
  return ffi::Error::Success();
}

}  // namespace pagedjax_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearCpu, pagedjax_cpu::Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N] or [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearMultiCpu, pagedjax_cpu::LinearMulti,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .RemainingArgs()               // w_j [K, N_j]
                                  .RemainingRets());             // y_j [M, N_j]

// Which copy of the kernel body this CPU runs (kernels/linear_cpu.py reports it): 1 for AVX2.
extern "C" int LinearCpuUsesAvx2() { return pagedjax_cpu::linear_uses_avx2() ? 1 : 0; }

// The copy in use (0 baseline, 1 AVX2, 2 AVX-512 for packed W) and the packed layout's strip
// width for it (linear_cpu.py pack lays W out for it).
extern "C" int LinearCpuIsa() { return pagedjax_cpu::isa_in_use(); }
extern "C" int LinearCpuPackedStrip() { return int(pagedjax_cpu::packed_strip()); }

// Runs copy `isa` from now on (at most the best; returns the copy then in use). Packed copies
// made for another strip width are refused by the handler's shape check, never misread.
extern "C" int LinearCpuUseIsa(int isa) {
  pagedjax_cpu::isa_in_use() = std::max(0, std::min(isa, pagedjax_cpu::best_isa()));
  return pagedjax_cpu::isa_in_use();
}
