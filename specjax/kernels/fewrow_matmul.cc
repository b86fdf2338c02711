// y[T, N] = x[T, K] @ w[K, N] in tiles of a few rows (at most 8: a decode step or a
// scoring pass is one tile; a prompt's rows are many, each panel swept once per tile while
// it is in cache), as XLA FFI custom calls for the CPU backend, with w packed once into
// panels: wp[P, K, 64] holds columns 64p..64p+63 of w (zeros past N), row after row, so
// each panel is one contiguous run. Three weight formats share the one loop
// (`Tile<T, C, F>`): float32 panels; int8 panels with a float32 scale per column (w = q *
// scale, symmetric per output channel), dequantized in registers: a column's sum is over
// x[t, k] * q[k, n] and is scaled once at the end, so a quarter of the bytes are read; and
// grouped panels, with a float16 scale and minimum per column and group of 32 rows of k (w
// = code * scale + min), whose codes are multiplied as they are and each group's scale and
// minimum applied once at its end: 4-bit codes, two per byte, 32 bytes per panel row
// (GGUF's Q4_1 and, with min = -8 scale, Q4_0: an eighth of the float32 bytes plus the
// groups' scales), or int8 codes (GGUF's Q8_0, min 0).
//
// The A8 formats multiply int8 *activations* by the codes, as llama.cpp does: each row of x
// is rounded to int8 per group of 32 inputs (scale = the group's max |x| / 127), and the
// integer products of a group are summed exactly in int32 (AVX-512 VNNI's `vpdpbusd`: 64
// byte products per instruction; AVX-VNNI, AVX2's pair sums or plain integer vectors
// elsewhere, all giving the same integers). The weights are then y = sum_g dx_g (scale_g
// S_g + min_g sum(xq)_g), where S_g is the group's sum of xq * code: x as rounded times W
// as stored. Their panels hold 4 inputs of a column side by side, the layout the byte dot
// product reads: a quad-row (inputs 4q..4q+3 of the panel's 64 columns) is 128 bytes for
// 4-bit codes (byte b: input 4q + b % 4 of column b / 4 in its low nibble, of column
// 32 + b / 4 in its high one) or 256 for 8-bit codes stored as code + 128 (byte b: input
// 4q + b % 4 of column b / 4; the minimums carry the -128 scale).
//
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

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

// The weight formats: what one panel row holds (kElems of W) and how many floats of side
// data (`aux`) each panel has: int8's 64 column scales; the grouped formats' scale and
// minimum for each group of kGroup rows and each column, [G, 2, 64].
constexpr int64_t kGroup = 32;  // grouped formats: rows of k per scale and minimum
inline int64_t GroupAux(int64_t K) { return 2 * kPanel * ((K + kGroup - 1) / kGroup); }
struct F32 {
  using W = float;
  using A = float;
  static constexpr int64_t kElems = kPanel;
  static constexpr bool kGrouped = false;
  static int64_t Aux(int64_t) { return 0; }
};
struct I8 {
  using W = int8_t;
  using A = float;
  static constexpr int64_t kElems = kPanel;
  static constexpr bool kGrouped = false;
  static int64_t Aux(int64_t) { return kPanel; }
};
struct I4 {
  using W = uint8_t;  // byte b of a row: column b in the low nibble, column b + 32 in the high one
  using A = uint16_t;  // the groups' scales and minimums: float16
  static constexpr int64_t kElems = kPanel / 2;
  static constexpr bool kGrouped = true;
  static int64_t Aux(int64_t K) { return GroupAux(K); }
};
struct G8 {
  using W = int8_t;
  using A = uint16_t;
  static constexpr int64_t kElems = kPanel;
  static constexpr bool kGrouped = true;
  static int64_t Aux(int64_t K) { return GroupAux(K); }
};

// kWidth float16 values (IEEE half bits) as floats: the grouped formats' scales and
// minimums are stored so (GGUF stores them so too: no value changes), a sixth fewer bytes
// per 4-bit weight than float32 ones.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline Vec LoadHalf(const uint16_t* p) {
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  Vec v;
  for (int i = 0; i < kWidth; ++i) v[i] = HalfToFloat(p[i]);
  return v;
#endif
}

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

// Columns c*kWidth .. c*kWidth + kWidth - 1 of an int4 panel row as floats 0..15: the low
// nibbles of bytes c*kWidth.. for the first 32 columns, the high nibbles of bytes
// c*kWidth - 32.. for the rest (one zero-extending load, a mask or a shift, a conversion).
inline Vec Codes(const uint8_t* row, int c) {
  const bool high = c * kWidth >= kPanel / 2;
  const uint8_t* p = row + c * kWidth - (high ? kPanel / 2 : 0);
#if defined(__AVX512F__)
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
  return (Vec)_mm512_cvtepi32_ps(v);
#elif defined(__AVX2__)
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  v = high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
  return (Vec)_mm256_cvtepi32_ps(v);
#else
  Vec v;
  for (int i = 0; i < kWidth; ++i) v[i] = static_cast<float>(high ? p[i] >> 4 : p[i] & 15);
  return v;
#endif
}

// out[t, :kPanel] (row stride ldo) = x[t, :] @ panel (times scale[:kPanel], for int8). The
// whole panel row is one tile for every T <= 8 and vector width, so each panel is swept
// once: with 8-16 vector registers some of the T x kVecs sums spill to L1, which costs far
// less than sweeping the panel again per half (measured on AVX-512, and on AVX2 code on
// the same host: T=5 with quarter-width tiles 3.8 ms per 84 MB of matrices, with the full
// tile 1.6).
//
// A grouped format sums x times the raw codes over each group of kGroup rows and applies
// the group's scale and minimum once at its end: sum_k x_k (code_k s + m) = s sum_k x_k
// code_k + m sum_k x_k, with sum_k x_k (`xsum`, [T, G]) computed once per call for every
// panel. Dequantizing each weight as it streamed past cost one more vector instruction per
// kWidth weights, and at T = 1 the grouped kernels are bound by their instructions (a
// load, a widening, a mask or shift and a conversion per kWidth codes), not by memory.
//
// `C` vectors from the `c0`-th: the whole panel row (C = kVecs) for a decode step's or a
// scoring pass's rows, read once from memory; a run of more rows (a prefill) re-reads the
// panel from cache per tile anyway, so it goes in tiles whose sums fit the registers
// (kRunRows x kRunVecs, below).
template <int T, int C, typename F>
inline void Tile(const float* x, const typename F::W* panel, const typename F::A* aux, const float* xsum, int64_t K,
                 float* out, int64_t ldo, int c0) {
  constexpr int64_t kRow = F::kElems * sizeof(typename F::W);  // bytes per panel row
  Vec acc[T][C] = {};
  auto row = [&](int64_t k, Vec (&sums)[T][C]) {
    const typename F::W* wk = panel + k * F::kElems;
    if (c0 == 0) {  // the whole row ahead: the first column tile brings the panel in for the rest
      const char* ahead = reinterpret_cast<const char*>(wk) + kAhead;
      for (int64_t b = 0; b < kRow; b += 64) __builtin_prefetch(ahead + b);
    }
    Vec w[C];
    for (int c = 0; c < C; ++c) {
      if constexpr (std::is_same_v<F, I4>) w[c] = Codes(wk, c0 + c);
      else w[c] = Weights(wk + (c0 + c) * kWidth);
    }
    for (int t = 0; t < T; ++t) {
      const Vec b = Splat(x[t * K + k]);
      for (int c = 0; c < C; ++c) sums[t][c] += w[c] * b;
    }
  };
  if constexpr (F::kGrouped) {
    const int64_t G = (K + kGroup - 1) / kGroup;
    for (int64_t g = 0; g < G; ++g) {
      Vec part[T][C] = {};
      for (int64_t k = g * kGroup; k < std::min(K, (g + 1) * kGroup); ++k) row(k, part);
      const uint16_t* a = aux + g * 2 * kPanel;
      for (int c = 0; c < C; ++c) {
        const Vec scale = LoadHalf(a + (c0 + c) * kWidth), low = LoadHalf(a + kPanel + (c0 + c) * kWidth);
        for (int t = 0; t < T; ++t) acc[t][c] += part[t][c] * scale + Splat(xsum[t * G + g]) * low;
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) row(k, acc);
  }
  if constexpr (std::is_same_v<F, I8>)
    for (int c = 0; c < C; ++c) {
      const Vec s = Load(aux + (c0 + c) * kWidth);
      for (int t = 0; t < T; ++t) acc[t][c] *= s;
    }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) Store(out + t * ldo + (c0 + c) * kWidth, acc[t][c]);
}

// Rows per tile, at most: a float-activation tile of up to 8 rows sweeps a panel once (its
// sums spill to L1, which costs less than a second sweep); an A8 tile's int32 sums and
// byte dot products are cheap enough that spilling them is not, so more than 4 rows go in
// tiles of 4, each sweeping the panel while it is in L1/L2 (benchmarks/real_model.md).
// A run of more than 8 float-activation rows goes in tiles of kRunRows rows by kRunVecs
// vectors of columns: with AVX2's 16 registers, 6 x 2 sums, 2 weights and a broadcast
// (8 x 8 sums spilled on every k, slower than XLA's dot: benchmarks/real_model.md);
// AVX-512's 32 hold the whole panel's 8 x 4.
constexpr int64_t kFloatTile = kMaxRows, kA8Tile = 4;
#if defined(__AVX512F__)
constexpr int kRunRows = kMaxRows, kRunVecs = kVecs;
#else
constexpr int kRunRows = 6, kRunVecs = 2;
#endif
static_assert(kVecs % kRunVecs == 0 && kRunRows <= kMaxRows);

template <typename F>
using TileFn = void (*)(const float*, const typename F::W*, const typename F::A*, const float*, int64_t, float*,
                        int64_t, int);
template <int C, typename F>
constexpr TileFn<F> kTiles[kMaxRows + 1] = {nullptr,          Tile<1, C, F>, Tile<2, C, F>, Tile<3, C, F>,
                                            Tile<4, C, F>,    Tile<5, C, F>, Tile<6, C, F>, Tile<7, C, F>,
                                            Tile<8, C, F>};

// y[:T, 64p0 : 64p1] (clipped to N) for panels p0..p1-1, by `tile_at(p, r, n, out, ldo)`,
// which writes rows r..r+n-1 of panel p's 64 columns at out (row stride ldo). Any T: each
// panel is swept once per tile of at most `tile` rows, one tile after the other, so a
// panel read from memory for the first tile is in L1/L2 for the rest.
template <typename TileAt>
inline void SweepPanels(float* y, int64_t T, int64_t N, int64_t p0, int64_t p1, int64_t tile, TileAt tile_at) {
  float last[kMaxRows * kPanel];  // a panel that runs past N is computed here, then clipped
  for (int64_t p = p0; p < p1; ++p) {
    const bool full = (p + 1) * kPanel <= N;
    for (int64_t r = 0; r < T; r += tile) {
      const int64_t n = std::min(tile, T - r);
      tile_at(p, r, n, full ? y + r * N + p * kPanel : last, full ? N : kPanel);
      if (!full)
        for (int64_t t = 0; t < n; ++t)
          std::memcpy(y + (r + t) * N + p * kPanel, last + t * kPanel, (N - p * kPanel) * sizeof(float));
    }
  }
}

// The float-activation formats' panels; aux: each panel's F::Aux(K) values.
template <typename F>
void Panels(const float* x, const void* wv, const void* av, const float* xsum, float* y, int64_t T, int64_t K,
            int64_t N, int64_t p0, int64_t p1) {
  const typename F::W* wp = static_cast<const typename F::W*>(wv);
  const typename F::A* aux = static_cast<const typename F::A*>(av);
  const int64_t G = (K + kGroup - 1) / kGroup;
  const bool run = T > kFloatTile;
  SweepPanels(y, T, N, p0, p1, run ? kRunRows : kFloatTile, [=](int64_t p, int64_t r, int64_t n, float* out,
                                                               int64_t ldo) {
    const typename F::W* panel = wp + p * K * F::kElems;
    const typename F::A* a = aux ? aux + p * F::Aux(K) : nullptr;
    const float* xs = xsum ? xsum + r * G : nullptr;
    if (!run) return kTiles<kVecs, F>[n](x + r * K, panel, a, xs, K, out, ldo, 0);
    for (int c0 = 0; c0 < kVecs; c0 += kRunVecs) kTiles<kRunVecs, F>[n](x + r * K, panel, a, xs, K, out, ldo, c0);
  });
}

using PanelFn = void (*)(const float*, const void*, const void*, const float*, float*, int64_t, int64_t, int64_t,
                         int64_t, int64_t);

// Rows per pass over the panels (a multiple of kMaxRows): the passes' inputs (`row_bytes`
// each) stay within about L2 while every panel streams past them, so a long run of rows
// (a prompt's prefill) reads each weight once per pass, and the inputs do not spill.
inline int64_t RowsPerPass(int64_t row_bytes) {
  constexpr int64_t kBudget = 256 << 10;
  return std::max<int64_t>(kMaxRows, kBudget / std::max<int64_t>(1, row_bytes) / kMaxRows * kMaxRows);
}

// fn(p0, p1) over the P panels: on this thread for a small matrix (k_by_n weights; a second
// thread costs more to wake than it saves), else in as many ranges as the pool has threads,
// each taken by whichever thread comes first.
template <typename Fn>
void SplitPanels(ffi::ThreadPool& pool, int64_t k_by_n, int64_t P, Fn fn) {
  const int64_t threads = k_by_n >= kMinSplit ? std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), P)) : 1;
  if (threads == 1) return fn(0, P);
  const int64_t per = (P + threads - 1) / threads, ranges = (P + per - 1) / per;
  ParallelFor(pool, ranges, ranges - 1, [=](int64_t r) { fn(r * per, std::min(P, (r + 1) * per)); });
}

// fn(r, n, p0, p1) for T rows in passes of RowsPerPass(row_bytes) (rows r..r+n-1), each
// pass over all P panels, split between threads as SplitPanels does.
template <typename Fn>
void InPasses(ffi::ThreadPool& pool, int64_t T, int64_t row_bytes, int64_t k_by_n, int64_t P, Fn fn) {
  const int64_t pass = RowsPerPass(row_bytes);
  for (int64_t r = 0; r < T; r += pass) {
    const int64_t n = std::min(pass, T - r);
    SplitPanels(pool, k_by_n, P, [=](int64_t p0, int64_t p1) { fn(r, n, p0, p1); });
  }
}

// The checks and the split between threads that the formats share (a panel row holds
// `row` elements); scale (int8's float32 scales, the grouped formats' float16 aux) is null
// for float32.
ffi::Error Run(ffi::ThreadPool& pool, const char* name, PanelFn fn, int64_t row, ffi::AnyBuffer::Dimensions xd,
               ffi::AnyBuffer::Dimensions wd, ffi::AnyBuffer::Dimensions yd, const float* xs, const void* ws,
               const void* scale, float* ys, bool grouped = false) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[0] < 1 || xd[1] != wd[1] ||
      wd[2] != row || yd[0] != xd[0] || yd[1] > wd[0] * kPanel || yd[1] <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(std::string(name) + ": want x[T, K], wp[P, K, " + std::to_string(row) +
                                       "] and y[T, N] with 64(P-1) < N <= 64P");
  const int64_t T = xd[0], K = xd[1], N = yd[1], P = wd[0];
  if (K == 0) {
    std::fill(ys, ys + T * N, 0.f);
    return ffi::Error::Success();
  }
  // Grouped formats: each row's sum over each group of kGroup inputs, in order (a row's
  // sums, like its outputs, do not depend on the rows beside it).
  const int64_t G = (K + kGroup - 1) / kGroup;
  thread_local std::vector<float> sums;
  sums.assign(grouped ? T * G : 0, 0.f);
  for (int64_t t = 0; grouped && t < T; ++t)
    for (int64_t k = 0; k < K; ++k) sums[t * G + k / kGroup] += xs[t * K + k];
  const float* xsum = grouped ? sums.data() : nullptr;
  InPasses(pool, T, K * sizeof(float), K * N, P, [=](int64_t r, int64_t n, int64_t p0, int64_t p1) {
    fn(xs + r * K, ws, scale, xsum ? xsum + r * G : nullptr, ys + r * N, n, K, N, p0, p1);
  });
  return ffi::Error::Success();
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                        ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, "specjax_fewrow_matmul", Panels<F32>, kPanel, x.dimensions(), wp.dimensions(), y->dimensions(),
             x.typed_data(), wp.typed_data(), nullptr, y->typed_data());
}

// wp holds int8 q; scale[P, 64] the columns' scales (any value past N: those columns are dropped).
ffi::Error FewRowMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wp,
                            ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[0] != wp.dimensions()[0] || sd[1] != kPanel)
    return ffi::Error::InvalidArgument("specjax_fewrow_matmul_int8: want scale[P, 64] for wp[P, K, 64]");
  return Run(pool, "specjax_fewrow_matmul_int8", Panels<I8>, kPanel, x.dimensions(), wp.dimensions(),
             y->dimensions(), x.typed_data(), wp.typed_data(), scale.typed_data(), y->typed_data());
}

// The grouped formats (`I4`: wp[P, K, 32] uint8, two codes per byte; `G8`: wp[P, K, 64]
// int8): aux[P, G, 2, 64] float16 holds each group's scales then minimums (G = ceil(K / 32);
// columns past N: any value, dropped).
template <typename F>
ffi::Error RunGrouped(ffi::ThreadPool& pool, const char* name, ffi::Buffer<ffi::F32>& x,
                      ffi::AnyBuffer::Dimensions wd, const void* wp, ffi::Buffer<ffi::F16>& aux,
                      ffi::ResultBuffer<ffi::F32>& y) {
  auto ad = aux.dimensions();
  if (wd.size() != 3 || ad.size() != 4 || ad[0] != wd[0] || ad[1] != (wd[1] + kGroup - 1) / kGroup || ad[2] != 2 ||
      ad[3] != kPanel)
    return ffi::Error::InvalidArgument(std::string(name) + ": want aux[P, ceil(K/32), 2, 64] for wp[P, K, " +
                                       std::to_string(F::kElems) + "]");
  return Run(pool, name, Panels<F>, F::kElems, x.dimensions(), wd, y->dimensions(), x.typed_data(), wp,
             aux.typed_data(), y->typed_data(), true);
}

ffi::Error FewRowMatmulInt4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wp,
                            ffi::Buffer<ffi::F16> aux, ffi::ResultBuffer<ffi::F32> y) {
  return RunGrouped<I4>(pool, "specjax_fewrow_matmul_int4", x, wp.dimensions(), wp.typed_data(), aux, y);
}

ffi::Error FewRowMatmulGrouped8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wp,
                                ffi::Buffer<ffi::F16> aux, ffi::ResultBuffer<ffi::F32> y) {
  return RunGrouped<G8>(pool, "specjax_fewrow_matmul_grouped8", x, wp.dimensions(), wp.typed_data(), aux, y);
}

// --------------------------------------------------------------------------- int8 activations

constexpr int64_t kQuads = kGroup / 4;  // quad-rows per group
typedef uint32_t UVec __attribute__((vector_size(kWidth * sizeof(uint32_t))));

// acc[i] += sum_j w.byte[4i + j] * x.byte[j] for every 32-bit lane i: w's bytes unsigned
// (codes), x's four bytes signed (inputs 4q..4q+3 of one row, the same in every lane).
// Every path gives the same integers: the sums are exact (at most 32 * 255 * 127 per group).
template <int Bits>
inline IVec Dot4(IVec acc, IVec w, int32_t x) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return (IVec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x));
#elif !defined(__AVX512F__) && defined(__AVXVNNI__)
  return (IVec)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(x));
#else
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (Bits == 4)  // pairs of 4-bit codes times int8 fit int16: no saturation
    return acc + (IVec)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)w, _mm512_set1_epi32(x)),
                                         _mm512_set1_epi16(1));
#elif !defined(__AVX512F__) && defined(__AVX2__)
  if constexpr (Bits == 4)
    return acc + (IVec)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(x)),
                                         _mm256_set1_epi16(1));
#endif
  int8_t b[4];
  std::memcpy(b, &x, 4);
  const UVec u = (UVec)w;
  return acc + (IVec)(u & 255u) * (int32_t)b[0] + (IVec)((u >> 8) & 255u) * (int32_t)b[1] +
         (IVec)((u >> 16) & 255u) * (int32_t)b[2] + (IVec)(u >> 24) * (int32_t)b[3];
#endif
}

// Columns c*kWidth .. c*kWidth + kWidth - 1 of a quad-row, one column's 4 codes per lane.
template <int Bits>
inline IVec QuadCodes(const uint8_t* row, int c) {
  IVec v;
  if constexpr (Bits == 8) {
    std::memcpy(&v, row + c * kWidth * 4, sizeof v);
    return v;
  }
  const bool high = c * kWidth >= kPanel / 2;
  std::memcpy(&v, row + (c * kWidth - (high ? kPanel / 2 : 0)) * 4, sizeof v);
  return high ? (IVec)(((UVec)v >> 4) & 0x0F0F0F0Fu) : (IVec)((UVec)v & 0x0F0F0F0Fu);
}

inline Vec ToFloat(IVec v) {
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps((__m512i)v);
#elif defined(__AVX__)
  return (Vec)_mm256_cvtepi32_ps((__m256i)v);
#else
  Vec f;
  for (int i = 0; i < kWidth; ++i) f[i] = static_cast<float>(v[i]);
  return f;
#endif
}

// out[t, :kPanel] = x[t] as rounded (xq [T, G*32] int8, xd [T, G] the groups' scales, xs
// [T, G] the sums of their codes) @ one panel (quad-rows [G*8, kRow], aux [G, 2, 64] float16).
template <int T, int Bits>
inline void TileA8(const int8_t* xq, const float* xd, const int32_t* xs, const uint8_t* panel, const uint16_t* aux,
                   int64_t G, float* out, int64_t ldo) {
  constexpr int C = kVecs;
  constexpr int64_t kRow = Bits == 4 ? 2 * kPanel : 4 * kPanel;  // bytes per quad-row
  const int64_t Kp = G * kGroup;
  Vec acc[T][C] = {};
  for (int64_t g = 0; g < G; ++g) {
    IVec part[T][C] = {};
    for (int64_t q = g * kQuads; q < (g + 1) * kQuads; ++q) {
      const uint8_t* wq = panel + q * kRow;
      for (int64_t b = 0; b < kRow; b += 64) __builtin_prefetch(wq + kAhead + b);
      IVec w[C];
      for (int c = 0; c < C; ++c) w[c] = QuadCodes<Bits>(wq, c);
      for (int t = 0; t < T; ++t) {
        int32_t x;
        std::memcpy(&x, xq + t * Kp + 4 * q, 4);
        for (int c = 0; c < C; ++c) part[t][c] = Dot4<Bits>(part[t][c], w[c], x);
      }
    }
    const uint16_t* a = aux + g * 2 * kPanel;
    for (int c = 0; c < C; ++c) {
      const Vec scale = LoadHalf(a + c * kWidth), low = LoadHalf(a + kPanel + c * kWidth);
      for (int t = 0; t < T; ++t)
        acc[t][c] += (ToFloat(part[t][c]) * scale + Splat(static_cast<float>(xs[t * G + g])) * low) *
                     Splat(xd[t * G + g]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) Store(out + t * ldo + c * kWidth, acc[t][c]);
}

template <int Bits>
using TileA8Fn = void (*)(const int8_t*, const float*, const int32_t*, const uint8_t*, const uint16_t*, int64_t, float*,
                          int64_t);
template <int Bits>
constexpr TileA8Fn<Bits> kTilesA8[kA8Tile + 1] = {nullptr, TileA8<1, Bits>, TileA8<2, Bits>, TileA8<3, Bits>,
                                                  TileA8<4, Bits>};

// As `Panels`, for the rows as rounded (xq [T, G*32], xd and xs [T, G]).
template <int Bits>
void PanelsA8(const int8_t* xq, const float* xd, const int32_t* xs, const uint8_t* wp, const uint16_t* aux, float* y,
              int64_t T, int64_t G, int64_t N, int64_t p0, int64_t p1) {
  constexpr int64_t kRow = Bits == 4 ? 2 * kPanel : 4 * kPanel;
  SweepPanels(y, T, N, p0, p1, kA8Tile, [=](int64_t p, int64_t r, int64_t n, float* out, int64_t ldo) {
    kTilesA8<Bits>[n](xq + r * G * kGroup, xd + r * G, xs + r * G, wp + p * G * kQuads * kRow,
                      aux + p * G * 2 * kPanel, G, out, ldo);
  });
}

// x [T, K] float32 times A8 panels wp [P, ceil(K/32) * 8, 128 (4-bit) or 256 (8-bit)] with
// aux [P, ceil(K/32), 2, 64] float16 (each group's scales, then minimums; columns past N: any value).
ffi::Error FewRowMatmulA8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wp,
                          ffi::Buffer<ffi::F16> aux, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = wp.dimensions(), ad = aux.dimensions(), yd = y->dimensions();
  const bool shapes = xd.size() == 2 && wd.size() == 3 && ad.size() == 4 && yd.size() == 2;
  const int64_t T = shapes ? xd[0] : 0, K = shapes ? xd[1] : 0, G = (K + kGroup - 1) / kGroup;
  if (!shapes || T < 1 || wd[1] != G * kQuads || (wd[2] != 2 * kPanel && wd[2] != 4 * kPanel) ||
      ad[0] != wd[0] || ad[1] != G || ad[2] != 2 || ad[3] != kPanel || yd[0] != T || yd[1] > wd[0] * kPanel ||
      yd[1] <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "specjax_fewrow_matmul_a8: want x[T, K], wp[P, ceil(K/32)*8, 128 or 256], aux[P, ceil(K/32), 2, 64] "
        "and y[T, N] with 64(P-1) < N <= 64P");
  const int64_t N = yd[1], P = wd[0];
  float* ys = y->typed_data();
  if (K == 0) {
    std::fill(ys, ys + T * N, 0.f);
    return ffi::Error::Success();
  }
  // Each row rounded to int8 per group (zeros past K): q = round(x / d), d = max |x| / 127,
  // round half to even (the default rounding mode, as XLA's round_nearest_even).
  const int64_t Kp = G * kGroup;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xdv;
  thread_local std::vector<int32_t> xsv;
  xq.assign(T * Kp, 0);
  xdv.assign(T * G, 0.f);
  xsv.assign(T * G, 0);
  const float* xs = x.typed_data();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xs[t * K + k]));
      const float d = amax / 127.f;
      int32_t sum = 0;
      if (d > 0.f)
        for (int64_t k = k0; k < k1; ++k) {
          const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xs[t * K + k] / d)));
          xq[t * Kp + k] = static_cast<int8_t>(v);
          sum += static_cast<int32_t>(v);
        }
      xdv[t * G + g] = d;
      xsv[t * G + g] = sum;
    }
  const auto fn = wd[2] == 2 * kPanel ? PanelsA8<4> : PanelsA8<8>;
  const int8_t* q = xq.data();
  const float* d = xdv.data();
  const int32_t* s = xsv.data();
  const uint8_t* w = wp.typed_data();
  const uint16_t* a = aux.typed_data();
  InPasses(pool, T, Kp, K * N, P, [=](int64_t r, int64_t n, int64_t p0, int64_t p1) {
    fn(q + r * Kp, d + r * G, s + r * G, w, a, ys + r * N, n, G, N, p0, p1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmulA8, FewRowMatmulA8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmulGrouped8, FewRowMatmulGrouped8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmulInt4, FewRowMatmulInt4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

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
