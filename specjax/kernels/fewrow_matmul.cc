// y[T, N] = x[T, K] @ w[K, N] for a few rows (T <= 8), float32, row-major, as an XLA FFI
// custom call for the CPU backend.
//
// XLA:CPU's dot for a handful of rows runs well below the rate at which the weights can be
// read, although it reads no more of them than a one-row dot. Here every weight element is
// loaded once and used for all T rows. The rows of w are split into one contiguous block
// per thread (so each thread streams sequential memory, which the prefetchers follow best;
// splitting the columns instead was much slower for T > 1), each block is walked in bands
// of kBand rows with the band's T x kBand inputs in registers and the T partial output
// rows in memory (L1/L2-resident), the next band is prefetched while one is computed, and
// the threads' partial sums are added at the end in a fixed order (results do not depend
// on which thread ran what). The threads are XLA's own intra-op pool (ffi::ThreadPool).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax;

constexpr int kMaxRows = 8;             // T
constexpr int64_t kMinBlock = 64;        // rows of w per thread, at least
constexpr int64_t kMinSplit = 1 << 16;  // elements of w below which one thread does it all

constexpr int kBand = 8;                 // rows of w per pass
// Prefetch the next band? With one row the loop is light enough for the hardware
// prefetchers alone (explicit prefetches slowed it down); with more rows each byte of w
// costs more work and the prefetches pay.
template <int T>
constexpr bool kPrefetch = T > 1;

// y[:, :nv] (+)= x[:, k:k+R] @ w[k:k+R, :nv], prefetching the rows of the next band.
template <int T, int R, bool First>
inline void Band(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t nv, int64_t k) {
  Vec b[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) b[t][r] = Splat(x[t * K + k + r]);
  const float* wk = w + k * N;
  for (int64_t n = 0; n < nv; n += kWidth) {
    if (kPrefetch<T>)
      for (int r = 0; r < R; ++r) __builtin_prefetch(wk + (R + r) * N + n);
    Vec wr[R];
    for (int r = 0; r < R; ++r) wr[r] = Load(wk + r * N + n);
    for (int t = 0; t < T; ++t) {
      Vec acc = First ? Vec{} : Load(y + t * N + n);
      for (int r = 0; r < R; ++r) acc += wr[r] * b[t][r];
      Store(y + t * N + n, acc);
    }
  }
}

// y = x[:, k0:k1] @ w[k0:k1, :] (k1 > k0).
template <int T>
void Block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t k0, int64_t k1) {
  const int64_t nv = N / kWidth * kWidth;
  int64_t k = k0;
  constexpr int R = kBand;
  if (k1 - k0 >= R) {
    Band<T, R, true>(x, w, y, K, N, nv, k);
    k += R;
  } else {
    Band<T, 1, true>(x, w, y, K, N, nv, k++);
  }
  for (; k + R <= k1; k += R) Band<T, R, false>(x, w, y, K, N, nv, k);
  for (; k < k1; ++k) Band<T, 1, false>(x, w, y, K, N, nv, k);
  for (int64_t n = nv; n < N; ++n)  // columns past the last full vector (where N % kWidth != 0)
    for (int t = 0; t < T; ++t) {
      float s = 0.f;
      for (int64_t kk = k0; kk < k1; ++kk) s += x[t * K + kk] * w[kk * N + n];
      y[t * N + n] = s;
    }
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr BlockFn kBlock[kMaxRows + 1] = {nullptr,  Block<1>, Block<2>, Block<3>, Block<4>,
                                          Block<5>, Block<6>, Block<7>, Block<8>};

// One matmul's row blocks, taken by whichever thread comes first: the calling thread never
// waits for a task that has not started, so a busy pool cannot stall it.
struct Job {
  BlockFn fn;
  const float* x;
  const float* w;
  float* y;
  int64_t T, K, N, rows;  // rows of w per block
  int blocks;
  std::vector<float> partial;  // blocks 1.. write here, block 0 straight into y
  std::atomic<int> next{0}, done{0};

  void Work() {
    for (int c; (c = next.fetch_add(1, std::memory_order_relaxed)) < blocks;) {
      float* out = c == 0 ? y : partial.data() + (c - 1) * T * N;
      fn(x, w, out, K, N, c * rows, std::min(K, (c + 1) * rows));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || xd[0] < 1 || xd[0] > kMaxRows || wd[0] < 1)
    return ffi::Error::InvalidArgument("specjax_fewrow_matmul: want x[T<=8, K>=1] and w[K, N]");
  const int64_t T = xd[0], K = wd[0], N = wd[1];
  if (N == 0) return ffi::Error::Success();
  // Small matrices: a second thread costs more to wake than it saves.
  int64_t threads = K * N >= kMinSplit ? std::max<int64_t>(1, pool.num_threads()) : 1;
  threads = std::max<int64_t>(1, std::min(threads, K / kMinBlock));
  if (threads == 1) {  // no job to share
    kBlock[T](x.typed_data(), w.typed_data(), y->typed_data(), K, N, 0, K);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job>();
  job->fn = kBlock[T];
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->T = T;
  job->K = K;
  job->N = N;
  job->rows = (K / threads + kBand - 1) / kBand * kBand;
  job->blocks = static_cast<int>((K + job->rows - 1) / job->rows);
  job->partial.resize((job->blocks - 1) * T * N);
  for (int i = 1; i < job->blocks; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  WaitFor(job->done, job->blocks);
  float* out = job->y;
  for (int c = 1; c < job->blocks; ++c) {
    const float* p = job->partial.data() + (c - 1) * T * N;
    for (int64_t i = 0; i < T * N; ++i) out[i] += p[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
