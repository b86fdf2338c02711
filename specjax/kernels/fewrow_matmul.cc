// y[T, N] = x[T, K] @ w[K, N] for a few rows (T <= 8), as XLA FFI custom calls for the
// CPU backend, with w packed once into panels: wp[P, K, 64] holds columns 64p..64p+63 of w
// (zeros past N), row after row, so each panel is one contiguous run. Two weight formats
// share the one loop (`Tile<T, W>`): float32 panels, and int8 panels with a float32 scale
// per column (w = q * scale, symmetric per output channel), dequantized in registers: a
// column's sum is over x[t, k] * q[k, n] and is scaled once at the end, so a quarter of
// the bytes are read.
//
// XLA:CPU's dot for a handful of rows runs well below the rate at which the weights can be
// read, although it reads no more of them than a one-row dot. Here a tile of a panel's
// columns keeps its T rows of partial sums in registers while the panel streams past once:
// every weight is loaded once, used for all T rows, and the sums never leave the registers
// until the panel ends. The panels are split between the threads of XLA's intra-op pool
// (ffi::ThreadPool) in contiguous ranges. Each output is one thread's sum over k in order,
// so the result is deterministic and a row's value does not depend on T (greedy ArS and SpS
// see identical logits).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax;

constexpr int kMaxRows = 8;              // T
constexpr int64_t kPanel = 64;           // columns per panel: fixed, so the layout is the same on every CPU
constexpr int kVecs = kPanel / kWidth;   // vectors per panel row
constexpr int64_t kAhead = 2048;         // bytes of a panel prefetched ahead: the hardware prefetchers alone fall behind
constexpr int64_t kMinSplit = 1 << 16;   // elements of w below which one thread does it all

// A panel row's kWidth weights from p as floats: a float load, or int8 widened in registers
// (AVX-512 and AVX2: one sign-extending load and one conversion; GCC 12 turned the vector
// extensions' conversion into one scalar conversion per lane, so they are the portable path).
inline Vec Weights(const float* p) { return Load(p); }
inline Vec Weights(const int8_t* p) {
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  Vec v;
  for (int i = 0; i < kWidth; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// out[t, :kPanel] (row stride ldo) = x[t, :] @ panel (times scale[:kPanel], for int8). The
// whole panel row is one tile for every T <= 8 and vector width, so each panel is swept
// once: with 8-16 vector registers some of the T x kVecs sums spill to L1, which costs far
// less than sweeping the panel again per half (measured on AVX-512, and on AVX2 code on
// the same host: T=5 with quarter-width tiles 3.8 ms per 84 MB of matrices, with the full
// tile 1.6).
template <int T, typename W>
inline void Tile(const float* x, const W* panel, const float* scale, int64_t K, float* out, int64_t ldo) {
  constexpr int C = kVecs;
  constexpr int64_t kRow = kPanel * sizeof(W);  // bytes per panel row
  Vec acc[T][C] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = panel + k * kPanel;
    const char* ahead = reinterpret_cast<const char*>(wk) + kAhead;
    for (int64_t b = 0; b < kRow; b += 64) __builtin_prefetch(ahead + b);
    Vec w[C];
    for (int c = 0; c < C; ++c) w[c] = Weights(wk + c * kWidth);
    for (int t = 0; t < T; ++t) {
      const Vec b = Splat(x[t * K + k]);
      for (int c = 0; c < C; ++c) acc[t][c] += w[c] * b;
    }
  }
  if constexpr (!std::is_same_v<W, float>)
    for (int c = 0; c < C; ++c) {
      const Vec s = Load(scale + c * kWidth);
      for (int t = 0; t < T; ++t) acc[t][c] *= s;
    }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) Store(out + t * ldo + c * kWidth, acc[t][c]);
}

// y[:, 64p0 : 64p1] (clipped to N) for panels p0..p1-1; scale [P * 64] for int8 (else null).
template <int T, typename W>
void Panels(const float* x, const void* wv, const float* scale, float* y, int64_t K, int64_t N, int64_t p0,
            int64_t p1) {
  const W* wp = static_cast<const W*>(wv);
  float last[T * kPanel];  // a panel that runs past N is computed here, then clipped
  for (int64_t p = p0; p < p1; ++p) {
    const bool full = (p + 1) * kPanel <= N;
    float* out = full ? y + p * kPanel : last;
    Tile<T, W>(x, wp + p * K * kPanel, scale ? scale + p * kPanel : nullptr, K, out, full ? N : kPanel);
    if (!full)
      for (int t = 0; t < T; ++t) std::memcpy(y + t * N + p * kPanel, last + t * kPanel, (N - p * kPanel) * sizeof(float));
  }
}

using PanelFn = void (*)(const float*, const void*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <typename W>
constexpr PanelFn kPanels[kMaxRows + 1] = {nullptr,         Panels<1, W>, Panels<2, W>, Panels<3, W>, Panels<4, W>,
                                           Panels<5, W>, Panels<6, W>, Panels<7, W>, Panels<8, W>};

// One matmul's panel ranges, taken by whichever thread comes first: the calling thread
// never waits for a task that has not started, so a busy pool cannot stall it.
struct Job {
  PanelFn fn;
  const float* x;
  const void* wp;
  const float* scale;
  float* y;
  int64_t K, N, P, per;  // panels per range
  int ranges;
  std::atomic<int> next{0}, done{0};

  void Work() {
    for (int r; (r = next.fetch_add(1, std::memory_order_relaxed)) < ranges;) {
      fn(x, wp, scale, y, K, N, r * per, std::min(P, (r + 1) * per));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The checks and the split between threads that both formats share; scale is null for float32.
ffi::Error Run(ffi::ThreadPool& pool, const char* name, PanelFn const* fns, ffi::AnyBuffer::Dimensions xd,
               ffi::AnyBuffer::Dimensions wd, ffi::AnyBuffer::Dimensions yd, const float* xs, const void* ws,
               const float* scale, float* ys) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[0] < 1 || xd[0] > kMaxRows || xd[1] != wd[1] ||
      wd[2] != kPanel || yd[0] != xd[0] || yd[1] > wd[0] * kPanel || yd[1] <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(std::string(name) + ": want x[T<=8, K], wp[P, K, 64] and y[T, N] "
                                       "with 64(P-1) < N <= 64P");
  const int64_t T = xd[0], K = xd[1], N = yd[1], P = wd[0];
  if (K == 0) {
    std::fill(ys, ys + T * N, 0.f);
    return ffi::Error::Success();
  }
  // Small matrices: a second thread costs more to wake than it saves.
  const int64_t threads = K * N >= kMinSplit ? std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), P)) : 1;
  if (threads == 1) {
    fns[T](xs, ws, scale, ys, K, N, 0, P);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job>();
  job->fn = fns[T];
  job->x = xs;
  job->wp = ws;
  job->scale = scale;
  job->y = ys;
  job->K = K;
  job->N = N;
  job->P = P;
  job->per = (P + threads - 1) / threads;
  job->ranges = static_cast<int>((P + job->per - 1) / job->per);
  for (int i = 1; i < job->ranges; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  WaitFor(job->done, job->ranges);
  return ffi::Error::Success();
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                        ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, "specjax_fewrow_matmul", kPanels<float>, x.dimensions(), wp.dimensions(), y->dimensions(),
             x.typed_data(), wp.typed_data(), nullptr, y->typed_data());
}

// wp holds int8 q; scale[P, 64] the columns' scales (any value past N: those columns are dropped).
ffi::Error FewRowMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wp,
                            ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[0] != wp.dimensions()[0] || sd[1] != kPanel)
    return ffi::Error::InvalidArgument("specjax_fewrow_matmul_int8: want scale[P, 64] for wp[P, K, 64]");
  return Run(pool, "specjax_fewrow_matmul_int8", kPanels<int8_t>, x.dimensions(), wp.dimensions(),
             y->dimensions(), x.typed_data(), wp.typed_data(), scale.typed_data(), y->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmulInt8, FewRowMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
