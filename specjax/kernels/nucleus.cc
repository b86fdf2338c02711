// The top-p (nucleus) cut of rows of probabilities, as an XLA FFI custom call for the CPU
// backend: the rule of specjax.decode.sampling.nucleus. Keep p >= t*, the largest
// threshold whose kept mass is still >= top_p (ties at the boundary kept together),
// renormalised; t* is found by bisection over the float32 bit patterns (ordered like the
// values, as p >= 0), so it is one of the probabilities exactly. XLA:CPU runs the
// bisection's 32 masked sums as a loop of small ops, which inside the decode loops costs
// tens of microseconds a row; here each row's sums run over data in L1.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax;

// The mass of p[i] with bits(p[i]) >= t.
float MassFrom(const float* p, int64_t V, int32_t t) {
  const IVec tv = IVec{} + t;
  Vec acc{};
  int64_t i = 0;
  for (; i + kWidth <= V; i += kWidth) {
    const Vec v = Load(p + i);
    IVec b;
    std::memcpy(&b, &v, sizeof b);
    acc += (Vec)((IVec)v & (b >= tv));
  }
  float tail = 0.f;
  for (; i < V; ++i) {
    int32_t b;
    std::memcpy(&b, p + i, sizeof b);
    if (b >= t) tail += p[i];
  }
  return Sum(acc) + tail;
}

void Row(const float* p, float* out, int64_t V, float top_p) {
  int32_t top = 0;  // the largest bit pattern
  for (int64_t i = 0; i < V; ++i) {
    int32_t b;
    std::memcpy(&b, p + i, sizeof b);
    top = std::max(top, b);
  }
  int64_t lo = 0, hi = int64_t{top} + 1;  // lo keeps everything (mass 1 >= top_p), hi nothing
  for (int step = 0; step < 32; ++step) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (MassFrom(p, V, static_cast<int32_t>(std::min<int64_t>(mid, INT32_MAX))) >= top_p)
      lo = mid;
    else
      hi = mid;
  }
  const int32_t t = static_cast<int32_t>(std::min<int64_t>(lo, INT32_MAX));
  const float kept = MassFrom(p, V, t);
  for (int64_t i = 0; i < V; ++i) {
    int32_t b;
    std::memcpy(&b, p + i, sizeof b);
    out[i] = (b >= t ? p[i] : 0.f) / kept;
  }
}

// top_p is an operand, one value per row (not an attribute): a traced setting, so that one
// compiled program serves every top_p.
ffi::Error Nucleus(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> mass,
                   ffi::ResultBuffer<ffi::F32> out) {
  const auto d = probs.dimensions();
  if (d.size() < 1 || d.back() < 1)
    return ffi::Error::InvalidArgument("specjax_nucleus: want probabilities [..., V] with V >= 1");
  const int64_t V = d.back(), rows = probs.element_count() / V;
  if (mass.element_count() != rows)
    return ffi::Error::InvalidArgument("specjax_nucleus: want one top_p per row of probabilities");
  const float* in = probs.typed_data();
  const float* top_p = mass.typed_data();
  float* res = out->typed_data();
  // Rows split over XLA's thread pool in chunks (a large batch, or a scoring pass's K + 1
  // rows per batch row), a few chunks a thread so that uneven rows balance.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(1, rows / (4 * threads)), items = (rows + chunk - 1) / chunk;
  ParallelFor(pool, items, std::min<int64_t>(items, threads) - 1, [=](int64_t i) {
    for (int64_t r = i * chunk; r < std::min(rows, (i + 1) * chunk); ++r) Row(in + r * V, res + r * V, V, top_p[r]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxNucleus, Nucleus,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
