// y[T, N] = x[T, K] @ w[K, N] for a few rows (T <= 8), float32, as an XLA FFI custom call
// for the CPU backend, with w packed once into panels: wp[P, K, 64] holds columns
// 64p..64p+63 of w (zeros past N), row after row, so each panel is one contiguous run.
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

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax;

constexpr int kMaxRows = 8;              // T
constexpr int64_t kPanel = 64;           // columns per panel: fixed, so the layout is the same on every CPU
constexpr int kVecs = kPanel / kWidth;   // vectors per panel row
constexpr int kPerLine = 16 / kWidth;    // vectors per 64-byte cache line
constexpr int64_t kAhead = 8;            // panel rows prefetched ahead (2 KB): the hardware prefetchers alone fall behind
constexpr int64_t kMinSplit = 1 << 16;   // elements of w below which one thread does it all

// out[t, :kPanel] (row stride ldo) = x[t, :] @ panel. The whole panel row is one tile for
// every T <= 8 and vector width, so each panel is swept once: with 8-16 vector registers
// some of the T x kVecs sums spill to L1, which costs far less than sweeping the panel
// again per half (measured on AVX-512, and on AVX2 code on the same host: T=5 with
// quarter-width tiles 3.8 ms per 84 MB of matrices, with the full tile 1.6).
template <int T>
inline void Tile(const float* x, const float* panel, int64_t K, float* out, int64_t ldo) {
  constexpr int C = kVecs;
  Vec acc[T][C] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = panel + k * kPanel;
    for (int c = 0; c < C; c += kPerLine) __builtin_prefetch(wk + kAhead * kPanel + c * kWidth);
    Vec w[C];
    for (int c = 0; c < C; ++c) w[c] = Load(wk + c * kWidth);
    for (int t = 0; t < T; ++t) {
      const Vec b = Splat(x[t * K + k]);
      for (int c = 0; c < C; ++c) acc[t][c] += w[c] * b;
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) Store(out + t * ldo + c * kWidth, acc[t][c]);
}

// y[:, 64p0 : 64p1] (clipped to N) for panels p0..p1-1.
template <int T>
void Panels(const float* x, const float* wp, float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  float last[T * kPanel];  // a panel that runs past N is computed here, then clipped
  for (int64_t p = p0; p < p1; ++p) {
    const bool full = (p + 1) * kPanel <= N;
    float* out = full ? y + p * kPanel : last;
    Tile<T>(x, wp + p * K * kPanel, K, out, full ? N : kPanel);
    if (!full)
      for (int t = 0; t < T; ++t) std::memcpy(y + t * N + p * kPanel, last + t * kPanel, (N - p * kPanel) * sizeof(float));
  }
}

using PanelFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr PanelFn kPanels[kMaxRows + 1] = {nullptr,   Panels<1>, Panels<2>, Panels<3>, Panels<4>,
                                           Panels<5>, Panels<6>, Panels<7>, Panels<8>};

// One matmul's panel ranges, taken by whichever thread comes first: the calling thread
// never waits for a task that has not started, so a busy pool cannot stall it.
struct Job {
  PanelFn fn;
  const float *x, *wp;
  float* y;
  int64_t K, N, P, per;  // panels per range
  int ranges;
  std::atomic<int> next{0}, done{0};

  void Work() {
    for (int r; (r = next.fetch_add(1, std::memory_order_relaxed)) < ranges;) {
      fn(x, wp, y, K, N, r * per, std::min(P, (r + 1) * per));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[0] < 1 || xd[0] > kMaxRows || xd[1] != wd[1] ||
      wd[2] != kPanel || yd[0] != xd[0] || yd[1] > wd[0] * kPanel || yd[1] <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument("specjax_fewrow_matmul: want x[T<=8, K], wp[P, K, 64] and y[T, N] "
                                       "with 64(P-1) < N <= 64P");
  const int64_t T = xd[0], K = xd[1], N = yd[1], P = wd[0];
  const float *xs = x.typed_data(), *ws = wp.typed_data();
  float* ys = y->typed_data();
  if (K == 0) {
    std::fill(ys, ys + T * N, 0.f);
    return ffi::Error::Success();
  }
  // Small matrices: a second thread costs more to wake than it saves.
  const int64_t threads = K * N >= kMinSplit ? std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), P)) : 1;
  if (threads == 1) {
    kPanels[T](xs, ws, ys, K, N, 0, P);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job>();
  job->fn = kPanels[T];
  job->x = xs;
  job->wp = ws;
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
