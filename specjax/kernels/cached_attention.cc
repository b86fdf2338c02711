// Attention of a few new queries over one layer of the stacked KV cache, read in place,
// as an XLA FFI custom call for the CPU backend:
//
//   out[b, t, n, :] = sum_s softmax_s(q[b, t, n] . k[layer, b, n / R, s] * scale) v[layer, b, n / R, s]
//
// over the keys s visible to query (b, t): s <= positions[b, t] and s < lengths[b]. A
// query that sees no key gets the uniform average over all S slots, as a softmax over
// all-masked logits does. Given the whole [L, B, G, S, H] cache and the layer index, XLA
// has no layer slice to copy (it copied, and for values transposed, each layer's cache
// before its attention dots, every step), and only the visible prefix of the cache is
// read, not all S slots. Work is split over (batch row, kv head) pairs, each of which
// reads its keys and values once for all T x R queries that share them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax;

// exp(x) for x <= 0 (a softmax's shifted logits), 0 below the float range; Cephes' expf
// polynomial after the reduction x = n ln2 + r.
inline Vec Exp(Vec x) {
  const Vec tiny = Splat(-87.3f);
  const IVec under = x < tiny;
  x = under ? tiny : x;
  Vec fx = x * 1.44269504088896341f + 0.5f;
  const IVec ni = __builtin_convertvector(fx, IVec);
  Vec fn = __builtin_convertvector(ni, Vec);
  fn = fn > fx ? fn - 1.f : fn;  // floor
  Vec r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  Vec p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const IVec bits = (__builtin_convertvector(fn, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? Vec{} : p * scale;
}

inline float Dot(const float* a, const float* b, int64_t H) {
  int64_t h = 0;
  float s = 0.f;
  if (H >= kWidth) {
    Vec acc{};
    for (; h + kWidth <= H; h += kWidth) acc += Load(a + h) * Load(b + h);
    s = Sum(acc);
  }
  for (; h < H; ++h) s += a[h] * b[h];
  return s;
}

struct Shapes {
  int64_t B, T, N, G, S, H, R;
};

// All T x R queries of batch row b that share kv head kh.
void Attend(const Shapes& d, const float* q, const float* kc, const float* vc, const int32_t* positions,
            int32_t length, float scale, float* out, int64_t b, int64_t kh) {
  const int64_t rows = d.T * d.R, H = d.H;
  std::vector<int64_t> span(d.T);
  std::vector<bool> uniform(d.T);
  int64_t smax = 0;
  for (int64_t t = 0; t < d.T; ++t) {
    const int64_t visible = std::clamp<int64_t>(std::min<int64_t>(positions[b * d.T + t] + 1, length), 0, d.S);
    uniform[t] = visible == 0;
    span[t] = visible == 0 ? d.S : visible;
    smax = std::max(smax, span[t]);
  }
  const int64_t stride = (smax + kWidth - 1) / kWidth * kWidth;
  std::vector<float> p(rows * stride, -INFINITY), acc(rows * H, 0.f), total(rows);
  const float* keys = kc + (b * d.G + kh) * d.S * H;
  const float* values = vc + (b * d.G + kh) * d.S * H;
  auto query = [&](int64_t row) { return q + ((b * d.T + row / d.R) * d.N + kh * d.R + row % d.R) * H; };
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row / d.R;
    float* pr = p.data() + row * stride;
    if (uniform[t]) {
      std::fill(pr, pr + d.S, 0.f);
    } else {
      const float* qr = query(row);
      for (int64_t s = 0; s < span[t]; ++s) pr[s] = Dot(qr, keys + s * H, H) * scale;
    }
    float m = -INFINITY;
    for (int64_t s = 0; s < span[t]; ++s) m = std::max(m, pr[s]);
    Vec sum{};
    for (int64_t s = 0; s < stride; s += kWidth) {
      const Vec e = Exp(Load(pr + s) - m);
      Store(pr + s, e);
      sum += e;
    }
    total[row] = Sum(sum);
  }
  for (int64_t s = 0; s < smax; ++s) {  // every value row once, for all queries
    const float* vs = values + s * H;
    for (int64_t row = 0; row < rows; ++row) {
      const float w = p[row * stride + s];
      float* a = acc.data() + row * H;
      for (int64_t h = 0; h < H; ++h) a[h] += w * vs[h];
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const float inv = 1.f / total[row];
    float* o = out + ((b * d.T + row / d.R) * d.N + kh * d.R + row % d.R) * H;
    for (int64_t h = 0; h < H; ++h) o[h] = acc[row * H + h] * inv;
  }
}

struct Job {
  Shapes d;
  const float *q, *kc, *vc;
  const int32_t *positions, *lengths;
  float scale;
  float* out;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    const int64_t items = d.B * d.G;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      Attend(d, q, kc, vc, positions, lengths[i / d.G], scale, out, i / d.G, i % d.G);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_all,
                           ffi::Buffer<ffi::F32> v_all, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                           ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions(), cd = k_all.dimensions();
  const auto vd = v_all.dimensions();
  const bool same = vd.size() == cd.size() && std::equal(cd.begin(), cd.end(), vd.begin());
  if (qd.size() != 4 || cd.size() != 5 || !same || cd[1] != qd[0] || cd[4] != qd[3] || qd[2] % cd[2] != 0 ||
      positions.element_count() != qd[0] * qd[1] || lengths.element_count() != qd[0])
    return ffi::Error::InvalidArgument("specjax_cached_attention: want q[B,T,N,H], caches [L,B,G,S,H]");
  const int64_t L = cd[0], l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("specjax_cached_attention: layer out of range");
  auto job = std::make_shared<Job>();
  job->d = {qd[0], qd[1], qd[2], cd[2], cd[3], qd[3], qd[2] / cd[2]};
  const int64_t layer_size = cd[1] * cd[2] * cd[3] * cd[4];
  job->q = q.typed_data();
  job->kc = k_all.typed_data() + l * layer_size;
  job->vc = v_all.typed_data() + l * layer_size;
  job->positions = positions.typed_data();
  job->lengths = lengths.typed_data();
  job->scale = scale;
  job->out = out->typed_data();
  const int64_t items = job->d.B * job->d.G;
  const int64_t helpers = std::min<int64_t>(items, std::max<int64_t>(1, pool.num_threads())) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  WaitFor(job->done, items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCachedAttention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
