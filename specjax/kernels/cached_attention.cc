// Attention of a pass's few queries over one layer of the stacked KV cache, read in
// place, and over the pass's own keys, as an XLA FFI custom call for the CPU backend:
//
//   out[b, t, n, :] = sum_j softmax_j(q[b, t, n] . key_j * scale) value_j
//
// over the keys visible to query (b, t), in this order: the cache entries s < limit[b] of
// layer `layer` (kv head n / R), then the U own keys u with visible[t, u] (the pass's, after
// any of earlier passes that no cache holds; a chain's are causal, a tree's its ancestors;
// visible is [T, U], or [B, T, U] where each row's tree differs). A sliding layer (window >
// 0) also drops every key `window` or more positions before the query's (cache slot s
// holds position s; own key u is at positions[b, u], and query t, the pass's t-th key, at
// positions[b, U - T + t]); the cache slots before the window are neither scored nor
// summed, so a sliding layer reads only the window of its cache. A query that sees no key
// gets the uniform average over all S slots and U own keys, as a softmax over all-masked
// logits does. Given the
// whole [L, B, G, S, H] cache and the layer index, XLA has no layer slice to copy (it
// copied, and for values transposed, each layer's cache before its attention dots, every
// step), and only the cache's visible prefix is read, not all S slots. The visible keys
// of a query are laid out as one sequence (cache, then own keys in order) and summed in
// that order, so a chain's query sees the same sums as a one-token step at its position
// over a cache that holds the chain's earlier keys. Work is split over (batch row, kv
// head) pairs, each of which reads its keys and values once for all T x R queries.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// q_i . key_j for Q queries and the four keys at `keys` (rows of H), out[i * 4 + j]: each
// chunk of a key loaded once for the Q queries, each query's once for the four keys, and
// each query's four lane sums reduced together (`Sum4`); each equals Dot(q_i, key_j, H)
// exactly (the same products summed in the same order).
template <int Q>
inline void Dot4(const float* const* q, const float* keys, int64_t H, float* out) {
  Vec acc[Q][4] = {};
  int64_t h = 0;
  for (; h + kWidth <= H; h += kWidth)
    for (int j = 0; j < 4; ++j) {
      const Vec k = Load(keys + j * H + h);
      for (int i = 0; i < Q; ++i) acc[i][j] += Load(q[i] + h) * k;
    }
  for (int i = 0; i < Q; ++i) {
    Sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], out + 4 * i);
    for (int64_t r = h; r < H; ++r)
      for (int j = 0; j < 4; ++j) out[4 * i + j] += q[i][r] * keys[j * H + r];
  }
}

// acc[r, h] += sum over s < span of p[r * stride + s] * values[s, h], for the n <= kBlockRows
// rows of a block, adding the values in order of s (as a loop over s, then rows, would).
// Each chunk of Vecs vectors of h keeps its n x Vecs accumulators in registers across all
// span value rows (that loop loaded and stored each query's accumulator once per value
// row, which bound it at T > 1).
constexpr int kBlockRows = 4;
constexpr int kChunk = kWidth == 16 ? 4 : 2;  // vectors of h per chunk: n x kChunk sums fit the registers

template <int Rows, int Vecs>
inline void ValueChunk(const float* p, int64_t stride, const float* values, int64_t span, int64_t H, float* acc) {
  Vec a[Rows][Vecs];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Vecs; ++j) a[r][j] = Load(acc + r * H + j * kWidth);
  for (int64_t s = 0; s < span; ++s) {
    Vec v[Vecs];
    for (int j = 0; j < Vecs; ++j) v[j] = Load(values + s * H + j * kWidth);
    for (int r = 0; r < Rows; ++r) {
      const Vec w = Splat(p[r * stride + s]);
      for (int j = 0; j < Vecs; ++j) a[r][j] += w * v[j];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Vecs; ++j) Store(acc + r * H + j * kWidth, a[r][j]);
}

template <int Rows>
void ValueRows(const float* p, int64_t stride, const float* values, int64_t span, int64_t H, float* acc) {
  int64_t h = 0;
  for (; h + kChunk * kWidth <= H; h += kChunk * kWidth)
    ValueChunk<Rows, kChunk>(p, stride, values + h, span, H, acc + h);
  for (; h + kWidth <= H; h += kWidth) ValueChunk<Rows, 1>(p, stride, values + h, span, H, acc + h);
  if (h == H) return;
  for (int64_t s = 0; s < span; ++s)
    for (int r = 0; r < Rows; ++r) {
      const float w = p[r * stride + s];
      for (int64_t i = h; i < H; ++i) acc[r * H + i] += w * values[s * H + i];
    }
}

inline void ValueSums(const float* p, int64_t stride, const float* values, int64_t span, int64_t H, float* acc,
                      int n) {
  switch (n) {
    case 4: return ValueRows<4>(p, stride, values, span, H, acc);
    case 3: return ValueRows<3>(p, stride, values, span, H, acc);
    case 2: return ValueRows<2>(p, stride, values, span, H, acc);
    default: return ValueRows<1>(p, stride, values, span, H, acc);
  }
}

struct Shapes {
  int64_t B, T, N, G, S, H, R, U;  // U: own keys (T for a pass over its own keys only)
};

// All T x R queries of batch row b that share kv head kh.
void Attend(const Shapes& d, const float* q, const float* kc, const float* vc, const float* kn, const float* vn,
            const bool* visible, int32_t limit, const int32_t* positions, int32_t window, float scale, float* out,
            int64_t b, int64_t kh) {
  const int64_t T = d.T, U = d.U, rows = T * d.R, H = d.H;
  // own[t * U + i]: the i-th own key query t sees; count[t] of them. A query that sees
  // nothing at all sees everything, with equal logits (`uniform`).
  const int64_t cached = std::clamp<int64_t>(limit, 0, d.S);
  // Scratch kept per thread: a large batch calls this once per (row, kv head), and
  // allocating it per call cost more than the attention of a short row.
  thread_local std::vector<int64_t> own, count, first;
  thread_local std::vector<char> uniform;
  thread_local std::vector<float> p, acc, total;
  own.assign(T * U, 0);
  count.assign(T, 0);
  first.assign(T, 0);  // first[t]: the first cache slot query t sees (the window's start)
  uniform.assign(T, 0);
  bool any_uniform = false;
  const int32_t* pos = positions + b * U;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t at = pos[U - T + t];  // the query's position: the pass's keys come last
    if (window > 0) first[t] = std::clamp<int64_t>(at - window + 1, 0, cached);
    for (int64_t u = 0; u < U; ++u)
      if (visible[t * U + u] && (window <= 0 || at - pos[u] < window)) own[t * U + count[t]++] = u;
    uniform[t] = first[t] >= cached && count[t] == 0;
    if (uniform[t]) {
      any_uniform = true;
      for (int64_t u = 0; u < U; ++u) own[t * U + u] = u;
      count[t] = U;
    }
  }
  // Cache slots [0, span), then own keys from `span` on (span = limit unless a query
  // sees nothing, which spans every slot).
  const int64_t span = any_uniform ? d.S : cached;
  const int64_t stride = (span + U + kWidth - 1) / kWidth * kWidth;
  p.assign(rows * stride, -INFINITY);
  acc.assign(rows * H, 0.f);
  total.assign(rows, 0.f);
  const float* keys = kc + (b * d.G + kh) * d.S * H;
  const float* values = vc + (b * d.G + kh) * d.S * H;
  auto new_row = [&](const float* base, int64_t u) { return base + ((b * U + u) * d.G + kh) * H; };
  auto query = [&](int64_t row) { return q + ((b * T + row / d.R) * d.N + kh * d.R + row % d.R) * H; };
  // Scores against the cached keys, two queries at a time (uniform rows score nothing).
  thread_local std::vector<int64_t> scored;
  scored.clear();
  for (int64_t row = 0; row < rows; ++row)
    if (!uniform[row / d.R]) scored.push_back(row);
  for (size_t i = 0; i < scored.size(); i += 2) {
    const int n = scored.size() - i >= 2 ? 2 : 1;
    const float* qs[2] = {query(scored[i]), query(scored[i + n - 1])};
    float* pr[2] = {p.data() + scored[i] * stride, p.data() + scored[i + n - 1] * stride};
    const int64_t from[2] = {first[scored[i] / d.R], first[scored[i + n - 1] / d.R]};
    int64_t s = std::min(from[0], from[1]);
    if (H >= kWidth) {  // four keys at a time (below one vector of H, Dot is scalar anyway)
      float dots[8];
      for (; s + 4 <= cached; s += 4) {
        if (n == 2) Dot4<2>(qs, keys + s * H, H, dots); else Dot4<1>(qs, keys + s * H, H, dots);
        for (int r = 0; r < n; ++r)
          for (int j = 0; j < 4; ++j) pr[r][s + j] = dots[4 * r + j] * scale;
      }
    }
    for (int r = 0; r < n; ++r) {
      for (int64_t k = s; k < cached; ++k) pr[r][k] = Dot(qs[r], keys + k * H, H) * scale;
      std::fill(pr[r], pr[r] + from[r], -INFINITY);  // before this query's window
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row / d.R;
    float* pr = p.data() + row * stride;
    if (uniform[t]) {
      std::fill(pr, pr + span + U, 0.f);
    } else {
      const float* qr = query(row);
      for (int64_t i = 0; i < count[t]; ++i) pr[span + i] = Dot(qr, new_row(kn, own[t * U + i]), H) * scale;
    }
    // The largest logit, a vector of lanes at a time (one scalar max after another was a
    // chain of dependent instructions, a sixth of the kernel at T=8); the padding is -inf.
    Vec top = Splat(-INFINITY);
    for (int64_t s = 0; s < stride; s += kWidth) {
      const Vec x = Load(pr + s);
      top = top < x ? x : top;
    }
    const float m = Max(top);
    Vec sum{};
    for (int64_t s = 0; s < stride; s += kWidth) {
      const Vec e = Exp(Load(pr + s) - m);
      Store(pr + s, e);
      sum += e;
    }
    total[row] = Sum(sum);
  }
  for (int64_t row = 0; row < rows; row += kBlockRows) {  // every cached value row once per block of queries
    const int n = static_cast<int>(std::min<int64_t>(kBlockRows, rows - row));
    int64_t lo = span;  // the block's earliest visible slot (0 where a query is uniform)
    for (int r = 0; r < n; ++r) lo = std::min(lo, uniform[(row + r) / d.R] ? int64_t{0} : first[(row + r) / d.R]);
    ValueSums(p.data() + row * stride + lo, stride, values + lo * H, span - lo, H, acc.data() + row * H, n);
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row / d.R;
    float* a = acc.data() + row * H;
    for (int64_t i = 0; i < count[t]; ++i) {
      const float w = p[row * stride + span + i];
      const float* vs = new_row(vn, own[t * U + i]);
      for (int64_t h = 0; h < H; ++h) a[h] += w * vs[h];
    }
    const float inv = 1.f / total[row];
    float* o = out + ((b * T + t) * d.N + kh * d.R + row % d.R) * H;
    for (int64_t h = 0; h < H; ++h) o[h] = a[h] * inv;
  }
}

ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_all,
                           ffi::Buffer<ffi::F32> v_all, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::PRED> visible, ffi::Buffer<ffi::S32> limit,
                           ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> window,
                           ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions(), cd = k_all.dimensions(), nd = k_new.dimensions();
  const auto vd = v_all.dimensions(), nvd = v_new.dimensions();
  const bool same = vd.size() == cd.size() && std::equal(cd.begin(), cd.end(), vd.begin()) &&
                    nvd.size() == nd.size() && std::equal(nd.begin(), nd.end(), nvd.begin());
  const int64_t plane = qd.size() == 4 && nd.size() == 4 ? qd[1] * nd[1] : -1;  // T x U
  const bool per_row = qd.size() == 4 && visible.element_count() == qd[0] * plane;
  if (qd.size() != 4 || cd.size() != 5 || nd.size() != 4 || !same || cd[1] != qd[0] || cd[4] != qd[3] ||
      qd[2] % cd[2] != 0 || nd[0] != qd[0] || nd[1] < qd[1] || nd[2] != cd[2] || nd[3] != qd[3] ||
      (visible.element_count() != plane && !per_row) || limit.element_count() != qd[0] ||
      positions.element_count() != qd[0] * nd[1] || window.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "specjax_cached_attention: want q[B,T,N,H], caches [L,B,G,S,H], own k, v [B,U,G,H] (U >= T), visible "
        "[T,U] or [B,T,U], limit[B], positions[B,U], window[]");
  const int64_t L = cd[0], l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("specjax_cached_attention: layer out of range");
  const Shapes d = {qd[0], qd[1], qd[2], cd[2], cd[3], qd[3], qd[2] / cd[2], nd[1]};
  const int64_t layer_size = cd[1] * cd[2] * cd[3] * cd[4];
  const float *qs = q.typed_data(), *kc = k_all.typed_data() + l * layer_size;
  const float *vc = v_all.typed_data() + l * layer_size, *kn = k_new.typed_data(), *vn = v_new.typed_data();
  const bool* vis = visible.typed_data();
  const int32_t* limits = limit.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t w = window.typed_data()[0];
  float* res = out->typed_data();
  const int64_t items = d.B * d.G;  // (batch row, kv head) pairs
  ParallelFor(pool, items, std::min<int64_t>(items, std::max<int64_t>(1, pool.num_threads())) - 1,
              [=](int64_t i) {
                const int64_t b = i / d.G;
                Attend(d, qs, kc, vc, kn, vn, vis + (per_row ? b * plane : 0), limits[b], pos, w, scale, res, b,
                       i % d.G);
              });
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
