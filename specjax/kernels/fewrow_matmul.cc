// y[T, N] = x[T, K] @ w[K, N] in tiles of a few rows (at most 8: a decode step or a
// scoring pass is one tile; a prompt's rows are many, each panel swept once per tile while
// it is in cache), as XLA FFI custom calls for the CPU backend, with w packed once into
// panels: panel p holds columns 64p..64p+63 of w (zeros past N), row after row, so each
// panel is one contiguous run. The weight formats share one loop (`Tile<T, C, F>`):
// float32 panels; int8 panels with a float32 scale per column (w = q * scale, symmetric per
// output channel), dequantized in registers: a column's sum is over x[t, k] * q[k, n] and is
// scaled once at the end, so a quarter of the bytes are read; and the grouped formats
// (`Codes<Bits, Group>`), GGUF's blocks as stored:
//
//   w[k, n] = (code[k, n] - offset) * scale[g, n] + low[g, n],   g = k / Group,
//
// with codes of 4, 5, 6 or 8 bits, groups of 16 or 32 inputs, and per group either a
// float16 scale (and a float16 minimum, or an integer `offset` for symmetric blocks: Q4_0's
// 8, Q5_0's 16, Q8_0's 128, Q6_K's 32), or, for the K-quants' two-level scales, a float16
// scale (and minimum) per super-block of groups times an int8 factor per group (Q4_K's
// scale = d * sc: an 11-bit significand times a 6-bit integer, exact in float32). Each
// group's sum of x times the raw codes is scaled once at its end: sum_k x_k ((c_k - o) s + m)
// = s (sum_k x_k c_k - o sum_k x_k) + m sum_k x_k, with sum_k x_k (`xsum`) computed once per
// call. A panel row of codes is 32 bytes of nibbles (byte b: column b in the low nibble,
// column b + 32 in the high one), then one 8-byte bit plane per bit above 4 (bit c: column
// c's bit 4 + j); 8-bit codes are one signed byte each (code - 128, the offset less 128).
// So a Q4_K weight reads 4.625 bits, Q5_0 5.5, Q6_K 6.56, as in the file.
//
// The A8 formats multiply int8 *activations* by the codes, as llama.cpp does: each row of x
// is rounded to int8 per group of 32 inputs (scale = the group's max |x| / 127), and the
// integer products of a weight group are summed exactly in int32 (AVX-512 VNNI's `vpdpbusd`:
// 64 byte products per instruction; AVX-VNNI, AVX2's pair sums or plain integer vectors
// elsewhere, all giving the same integers). Then y = sum_g dx_g (scale_g (S_g - o X_g) +
// low_g X_g), where S_g is the group's sum of xq * code and X_g of xq: x as rounded times W
// as stored. Their panels hold 4 inputs of a column side by side, the layout the byte dot
// product reads: a quad-row (inputs 4q..4q+3 of the panel's 64 columns) is 128 bytes of
// 4-bit codes (byte b: input 4q + b % 4 of column b / 4 in its low nibble, of column
// 32 + b / 4 in its high one), then one 32-byte bit plane per bit above 4 (bit i: byte i's
// code's bit 4 + j, byte i as in a quad-row of 8-bit codes), or 256 bytes of 8-bit codes
// (byte b: input 4q + b % 4 of column b / 4, unsigned).
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
constexpr int64_t kGroup = 32;           // A8: inputs per activation scale

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

// kWidth int8 values widened to int32 (AVX-512 and AVX2: one sign-extending load; GCC 12
// turned the vector extensions' conversion into one scalar conversion per lane, so they
// are the portable path).
inline IVec Int8s(const int8_t* p) {
#if defined(__AVX512F__)
  return (IVec)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (IVec)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  IVec v;
  for (int i = 0; i < kWidth; ++i) v[i] = p[i];
  return v;
#endif
}

// Columns c*kWidth .. c*kWidth + kWidth - 1 of a panel row of 4..6-bit codes as int32: the
// low nibbles of bytes c*kWidth.. for the first 32 columns, the high nibbles of bytes
// c*kWidth - 32.. for the rest (one zero-extending load, a mask or a shift), then each bit
// plane's bits for those columns (AVX-512: a masked OR by the plane's 16 bits).
template <int Bits>
inline IVec RowCodes(const uint8_t* row, int c) {
  const bool high = c * kWidth >= kPanel / 2;
  const uint8_t* p = row + c * kWidth - (high ? kPanel / 2 : 0);
  const uint8_t* planes = row + kPanel / 2;
#if defined(__AVX512F__)
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
  for (int j = 0; j < Bits - 4; ++j) {
    uint16_t m;
    std::memcpy(&m, planes + j * kPanel / 8 + c * kWidth / 8, 2);
    v = _mm512_or_si512(v, _mm512_maskz_mov_epi32((__mmask16)m, _mm512_set1_epi32(16 << j)));
  }
  return (IVec)v;
#elif defined(__AVX2__)
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  v = high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
  for (int j = 0; j < Bits - 4; ++j) {
    const __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32(planes[j * kPanel / 8 + c]),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(1)), 4 + j));
  }
  return (IVec)v;
#else
  IVec v;
  for (int i = 0; i < kWidth; ++i) {
    const int col = c * kWidth + i;
    int code = high ? p[i] >> 4 : p[i] & 15;
    for (int j = 0; j < Bits - 4; ++j) code |= ((planes[j * kPanel / 8 + col / 8] >> (col % 8)) & 1) << (4 + j);
    v[i] = code;
  }
  return v;
#endif
}

// The float-activation formats: bytes per panel row (kRow) and a row's kWidth weights (or
// codes) from the c-th vector on, as floats.
struct F32 {
  static constexpr int64_t kRow = kPanel * sizeof(float);
  static constexpr int kGroupSize = 0;  // no groups
  static Vec At(const uint8_t* row, int c) { return Load(reinterpret_cast<const float*>(row) + c * kWidth); }
};
struct I8 {
  static constexpr int64_t kRow = kPanel;
  static constexpr int kGroupSize = 0;
  static Vec At(const uint8_t* row, int c) { return ToFloat(Int8s(reinterpret_cast<const int8_t*>(row) + c * kWidth)); }
};
template <int Bits, int Group>
struct Codes {
  static_assert(Bits == 4 || Bits == 5 || Bits == 6 || Bits == 8);
  static constexpr int64_t kRow = Bits == 8 ? kPanel : kPanel / 2 + (Bits - 4) * kPanel / 8;
  static constexpr int kGroupSize = Group;
  static Vec At(const uint8_t* row, int c) {
    if constexpr (Bits == 8) return ToFloat(Int8s(reinterpret_cast<const int8_t*>(row) + c * kWidth));
    else return ToFloat(RowCodes<Bits>(row, c));
  }
};

// One panel's side data: int8's column scales, or a grouped format's scales and minimums:
// `half` [S, parts, 64] float16 per group or, with `factor` [G, parts, 64] int8, per
// super-block of 2^per_shift groups (scale = half * factor); parts = 2 holds minimums, 1 an
// integer `offset` instead.
struct Side {
  const float* column = nullptr;
  const uint16_t* half = nullptr;
  const int8_t* factor = nullptr;
  int per_shift = 0;  // a shift, not a division: one per group was a fifth of a K-quant tile's time
  int parts = 1;
  int32_t offset = 0;

  // Group g's scale and minimum for the vectors c0.. (low untouched with parts == 1).
  template <int C>
  inline void At(int64_t g, int c0, Vec (&scale)[C], Vec (&low)[C]) const {
    const uint16_t* h = half + (g >> per_shift) * parts * kPanel;
    for (int c = 0; c < C; ++c) {
      scale[c] = LoadHalf(h + (c0 + c) * kWidth);
      if (parts == 2) low[c] = LoadHalf(h + kPanel + (c0 + c) * kWidth);
    }
    if (factor) {
      const int8_t* f = factor + g * parts * kPanel;
      for (int c = 0; c < C; ++c) {
        scale[c] *= ToFloat(Int8s(f + (c0 + c) * kWidth));
        if (parts == 2) low[c] *= ToFloat(Int8s(f + kPanel + (c0 + c) * kWidth));
      }
    }
  }
};

// The buffers of a call's side data, and panel p's share of them.
struct SideData {
  Side base;
  int64_t half_per_panel = 0, factor_per_panel = 0;
  Side Panel(int64_t p) const {
    Side s = base;
    if (s.column) s.column += p * kPanel;
    if (s.half) s.half += p * half_per_panel;
    if (s.factor) s.factor += p * factor_per_panel;
    return s;
  }
};

// out[t, :kPanel] (row stride ldo) = x[t, :] @ panel (times the column scales, for int8). The
// whole panel row is one tile for every T <= 8 and vector width, so each panel is swept
// once: with 8-16 vector registers some of the T x kVecs sums spill to L1, which costs far
// less than sweeping the panel again per half (measured on AVX-512, and on AVX2 code on
// the same host: T=5 with quarter-width tiles 3.8 ms per 84 MB of matrices, with the full
// tile 1.6).
//
// A grouped format sums x times the raw codes over each group and applies the group's
// scale and minimum (or offset) once at its end, with sum_k x_k (`xsum`, [T, G]) computed
// once per call for every panel. Dequantizing each weight as it streamed past cost one
// more vector instruction per kWidth weights, and at T = 1 the grouped kernels are bound by
// their instructions (a load, a widening, a mask or shift and a conversion per kWidth
// codes), not by memory.
//
// `C` vectors from the `c0`-th: the whole panel row (C = kVecs) for a decode step's or a
// scoring pass's rows, read once from memory; a run of more rows (a prefill) re-reads the
// panel from cache per tile anyway, so it goes in tiles whose sums fit the registers
// (kRunRows x kRunVecs, below).
template <int T, int C, typename F>
inline void Tile(const float* x, const uint8_t* panel, const Side& side, const float* xsum, int64_t K, float* out,
                 int64_t ldo, int c0) {
  Vec acc[T][C] = {};
  auto row = [&](int64_t k, Vec (&sums)[T][C]) {
    const uint8_t* wk = panel + k * F::kRow;
    if (c0 == 0) {  // the whole row ahead: the first column tile brings the panel in for the rest
      const uint8_t* ahead = wk + kAhead;
      for (int64_t b = 0; b < F::kRow; b += 64) __builtin_prefetch(ahead + b);
    }
    Vec w[C];
    for (int c = 0; c < C; ++c) w[c] = F::At(wk, c0 + c);
    for (int t = 0; t < T; ++t) {
      const Vec b = Splat(x[t * K + k]);
      for (int c = 0; c < C; ++c) sums[t][c] += w[c] * b;
    }
  };
  if constexpr (F::kGroupSize > 0) {
    constexpr int64_t kG = F::kGroupSize;
    const int64_t G = (K + kG - 1) / kG;
    for (int64_t g = 0; g < G; ++g) {
      Vec part[T][C] = {};
      for (int64_t k = g * kG; k < std::min(K, (g + 1) * kG); ++k) row(k, part);
      Vec scale[C], low[C];
      side.At(g, c0, scale, low);
      if (side.parts == 2) {
        for (int c = 0; c < C; ++c)
          for (int t = 0; t < T; ++t) acc[t][c] += part[t][c] * scale[c] + Splat(xsum[t * G + g]) * low[c];
      } else {
        for (int t = 0; t < T; ++t) {
          const Vec shift = Splat(static_cast<float>(side.offset) * xsum[t * G + g]);
          for (int c = 0; c < C; ++c) acc[t][c] += (part[t][c] - shift) * scale[c];
        }
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) row(k, acc);
  }
  if constexpr (std::is_same_v<F, I8>)
    for (int c = 0; c < C; ++c) {
      const Vec s = Load(side.column + (c0 + c) * kWidth);
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

using TileFn = void (*)(const float*, const uint8_t*, const Side&, const float*, int64_t, float*, int64_t, int);
template <int C, typename F>
constexpr TileFn kTiles[kMaxRows + 1] = {nullptr,          Tile<1, C, F>, Tile<2, C, F>, Tile<3, C, F>,
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

// The float-activation formats' panels (xsum: [T, G], each row's sums per group).
template <typename F>
void Panels(const float* x, const uint8_t* wp, const SideData& side, const float* xsum, float* y, int64_t T,
            int64_t K, int64_t N, int64_t p0, int64_t p1) {
  const int64_t G = F::kGroupSize > 0 ? (K + F::kGroupSize - 1) / F::kGroupSize : 0;
  const bool run = T > kFloatTile;
  SweepPanels(y, T, N, p0, p1, run ? kRunRows : kFloatTile, [=, &side](int64_t p, int64_t r, int64_t n, float* out,
                                                                       int64_t ldo) {
    const uint8_t* panel = wp + p * K * F::kRow;
    const Side s = side.Panel(p);
    const float* xs = xsum ? xsum + r * G : nullptr;
    if (!run) return kTiles<kVecs, F>[n](x + r * K, panel, s, xs, K, out, ldo, 0);
    for (int c0 = 0; c0 < kVecs; c0 += kRunVecs) kTiles<kRunVecs, F>[n](x + r * K, panel, s, xs, K, out, ldo, c0);
  });
}

using PanelFn = void (*)(const float*, const uint8_t*, const SideData&, const float*, float*, int64_t, int64_t,
                         int64_t, int64_t, int64_t);

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

ffi::Error ShapeError(const char* name, int64_t row) {
  return ffi::Error::InvalidArgument(std::string(name) + ": want x[T, K], wp[P, K, " + std::to_string(row) +
                                     "] and y[T, N] with 64(P-1) < N <= 64P");
}

// The checks and the split between threads that the float-activation formats share (a
// panel row holds F::kRow bytes); `group` > 0: each row's sums per group of inputs.
template <typename F>
ffi::Error Run(ffi::ThreadPool& pool, const char* name, ffi::AnyBuffer::Dimensions xd, ffi::AnyBuffer::Dimensions wd,
               int64_t row_elems, ffi::AnyBuffer::Dimensions yd, const float* xs, const uint8_t* ws,
               const SideData& side, float* ys) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[0] < 1 || xd[1] != wd[1] || wd[2] != row_elems ||
      yd[0] != xd[0] || yd[1] > wd[0] * kPanel || yd[1] <= (wd[0] - 1) * kPanel)
    return ShapeError(name, row_elems);
  const int64_t T = xd[0], K = xd[1], N = yd[1], P = wd[0];
  if (K == 0) {
    std::fill(ys, ys + T * N, 0.f);
    return ffi::Error::Success();
  }
  // Grouped formats: each row's sum over each group of inputs, in order (a row's sums,
  // like its outputs, do not depend on the rows beside it).
  constexpr int64_t kG = F::kGroupSize;
  const int64_t G = kG > 0 ? (K + kG - 1) / kG : 0;
  thread_local std::vector<float> sums;
  sums.assign(T * G, 0.f);
  for (int64_t t = 0; kG > 0 && t < T; ++t)
    for (int64_t k = 0; k < K; ++k) sums[t * G + k / kG] += xs[t * K + k];
  const float* xsum = kG > 0 ? sums.data() : nullptr;
  const SideData* sd = &side;
  InPasses(pool, T, K * sizeof(float), K * N, P, [=](int64_t r, int64_t n, int64_t p0, int64_t p1) {
    Panels<F>(xs + r * K, ws, *sd, xsum ? xsum + r * G : nullptr, ys + r * N, n, K, N, p0, p1);
  });
  return ffi::Error::Success();
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                        ffi::ResultBuffer<ffi::F32> y) {
  return Run<F32>(pool, "specjax_fewrow_matmul", x.dimensions(), wp.dimensions(), kPanel, y->dimensions(),
                  x.typed_data(), reinterpret_cast<const uint8_t*>(wp.typed_data()), SideData{}, y->typed_data());
}

// wp holds int8 q; scale[P, 64] the columns' scales (any value past N: those columns are dropped).
ffi::Error FewRowMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wp,
                            ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[0] != wp.dimensions()[0] || sd[1] != kPanel)
    return ffi::Error::InvalidArgument("specjax_fewrow_matmul_int8: want scale[P, 64] for wp[P, K, 64]");
  SideData side;
  side.base.column = scale.typed_data();
  return Run<I8>(pool, "specjax_fewrow_matmul_int8", x.dimensions(), wp.dimensions(), kPanel, y->dimensions(),
                 x.typed_data(), reinterpret_cast<const uint8_t*>(wp.typed_data()), side, y->typed_data());
}

// A grouped weight's side data from its buffers: half [P, S, parts, 64] float16, factor
// [P, F, parts, 64] int8 with F = 0 (one level: S = ceil(K / group) groups) or F >=
// ceil(K / group) groups, S super-blocks of F / S (a power of two) each (two levels). Empty
// message: the shapes fit.
std::string GroupedSide(ffi::AnyBuffer::Dimensions hd, ffi::AnyBuffer::Dimensions fd, int64_t P, int64_t K,
                        int32_t group, int32_t offset, const uint16_t* half, const int8_t* factor, SideData& side) {
  const int64_t G = group > 0 ? (K + group - 1) / group : 0;
  const int64_t F = fd.size() == 4 ? fd[1] : 0, S = hd.size() == 4 ? hd[1] : 0, per = F && S ? F / S : 1;
  if (hd.size() != 4 || fd.size() != 4 || hd[0] != P || fd[0] != P || (hd[2] != 1 && hd[2] != 2) ||
      fd[2] != hd[2] || hd[3] != kPanel || fd[3] != kPanel || S < 1 || (F == 0 && S != G) ||
      (F != 0 && (F < G || F % S != 0 || (per & (per - 1)) != 0)))
    return "want scales[P, S, 1 or 2, 64] and factors[P, 0, ., 64] with S = ceil(K / group), or factors[P, F, ., "
           "64] with F >= ceil(K / group) a power-of-two multiple of S";
  side.base.half = half;
  side.base.factor = F ? factor : nullptr;
  for (int64_t p = per; p > 1; p >>= 1) ++side.base.per_shift;
  side.base.parts = static_cast<int>(hd[2]);
  side.base.offset = offset;
  side.half_per_panel = hd[1] * hd[2] * kPanel;
  side.factor_per_panel = fd[1] * fd[2] * kPanel;
  return "";
}

// The grouped formats that GGUF's types need, as (bits, inputs per group): 4-bit codes in
// groups of 32 (Q4_0, Q4_1, Q4_K) or 16 (Q2_K and Q3_K's codes, widened), 5-bit in 32
// (Q5_0, Q5_1, Q5_K), 6-bit in 16 (Q6_K), 8-bit in 32 (Q8_0).
template <typename Pick>
auto ByFormat(int32_t bits, int32_t group, Pick pick) -> decltype(pick.template Get<4, 32>()) {
  if (bits == 4 && group == 32) return pick.template Get<4, 32>();
  if (bits == 4 && group == 16) return pick.template Get<4, 16>();
  if (bits == 5 && group == 32) return pick.template Get<5, 32>();
  if (bits == 6 && group == 16) return pick.template Get<6, 16>();
  if (bits == 8 && group == 32) return pick.template Get<8, 32>();
  return {};
}
constexpr const char* kFormats = "(bits, group) of (4, 32), (4, 16), (5, 32), (6, 16) or (8, 32)";

template <int Bits, int Group>
ffi::Error RunGrouped(ffi::ThreadPool* pool, ffi::Buffer<ffi::F32>* x, ffi::Buffer<ffi::U8>* wp, const SideData* side,
                      ffi::ResultBuffer<ffi::F32>* y) {
  using F = Codes<Bits, Group>;
  return Run<F>(*pool, "specjax_fewrow_matmul_grouped", x->dimensions(), wp->dimensions(), F::kRow,
                (*y)->dimensions(), x->typed_data(), wp->typed_data(), *side, (*y)->typed_data());
}

struct PickGrouped {
  template <int B, int G>
  auto Get() const { return RunGrouped<B, G>; }
};

// x [T, K] float32 times grouped panels wp [P, K, bytes per row] (Codes<bits, group>::kRow)
// with their scales and factors (GroupedSide); 8-bit codes signed (the offset less 128).
ffi::Error FewRowMatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wp,
                               ffi::Buffer<ffi::F16> half, ffi::Buffer<ffi::S8> factor, ffi::ResultBuffer<ffi::F32> y,
                               int32_t bits, int32_t group, int32_t offset) {
  using Fn = ffi::Error (*)(ffi::ThreadPool*, ffi::Buffer<ffi::F32>*, ffi::Buffer<ffi::U8>*, const SideData*,
                            ffi::ResultBuffer<ffi::F32>*);
  const Fn fn = ByFormat(bits, group, PickGrouped{});
  if (!fn) return ffi::Error::InvalidArgument(std::string("specjax_fewrow_matmul_grouped: want ") + kFormats);
  auto xd = x.dimensions();
  if (xd.size() != 2 || wp.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("specjax_fewrow_matmul_grouped: want x[T, K] and wp[P, K, bytes]");
  SideData side;
  const std::string bad = GroupedSide(half.dimensions(), factor.dimensions(), wp.dimensions()[0], xd[1], group, offset,
                                      reinterpret_cast<const uint16_t*>(half.typed_data()), factor.typed_data(), side);
  if (!bad.empty()) return ffi::Error::InvalidArgument("specjax_fewrow_matmul_grouped: " + bad);
  return fn(&pool, &x, &wp, &side, &y);
}

// --------------------------------------------------------------------------- int8 activations

constexpr int64_t kQuads = kGroup / 4;  // quad-rows per activation group
typedef uint32_t UVec __attribute__((vector_size(kWidth * sizeof(uint32_t))));

// Bytes per quad-row of 64 columns.
template <int Bits>
constexpr int64_t kQuadRow = Bits == 8 ? 4 * kPanel : 2 * kPanel + (Bits - 4) * kPanel / 2;

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
  if constexpr (Bits <= 6)  // pairs of codes below 64 times int8 fit int16: no saturation
    return acc + (IVec)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)w, _mm512_set1_epi32(x)),
                                         _mm512_set1_epi16(1));
#elif !defined(__AVX512F__) && defined(__AVX2__)
  if constexpr (Bits <= 6)
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

// Columns c*kWidth .. c*kWidth + kWidth - 1 of a quad-row, one column's 4 codes per lane:
// the nibbles, then each bit plane's 4 * kWidth bits for them (AVX-512: a masked byte add).
template <int Bits>
inline IVec QuadCodes(const uint8_t* row, int c) {
  IVec v;
  if constexpr (Bits == 8) {
    std::memcpy(&v, row + c * kWidth * 4, sizeof v);
    return v;
  } else {
    const bool high = c * kWidth >= kPanel / 2;
    std::memcpy(&v, row + (c * kWidth - (high ? kPanel / 2 : 0)) * 4, sizeof v);
    v = high ? (IVec)(((UVec)v >> 4) & 0x0F0F0F0Fu) : (IVec)((UVec)v & 0x0F0F0F0Fu);
    const uint8_t* planes = row + 2 * kPanel + c * kWidth / 2;  // 4 * kWidth bits = kWidth / 2 bytes
    for (int j = 0; j < Bits - 4; ++j) {
      const uint8_t* plane = planes + j * kPanel / 2;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // A zero-masked move and an OR: an in-place masked add made GCC copy the vector first.
      uint64_t m;
      std::memcpy(&m, plane, 8);
      v = (IVec)_mm512_or_si512((__m512i)v, _mm512_maskz_mov_epi8((__mmask64)m, _mm512_set1_epi8((char)(16 << j))));
#elif !defined(__AVX512F__) && defined(__AVX2__)
      uint32_t m;
      std::memcpy(&m, plane, 4);
      const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
      __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m),
                                      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                         0x0303030303030303LL));
      b = _mm256_cmpeq_epi8(_mm256_and_si256(b, select), select);
      v = (IVec)_mm256_or_si256((__m256i)v, _mm256_and_si256(b, _mm256_set1_epi8((char)(16 << j))));
#else
      UVec add = {};
      for (int i = 0; i < kWidth; ++i) {
        const uint32_t n = (plane[i / 2] >> (4 * (i % 2))) & 15u;  // lane i's 4 bits
        add[i] = ((n & 1u) | ((n & 2u) << 7) | ((n & 4u) << 14) | ((n & 8u) << 21)) << (4 + j);
      }
      v = (IVec)((UVec)v | add);
#endif
    }
    return v;
  }
}

// out[t, :kPanel] = x[t] as rounded (xq [T, G*32] int8, xd [T, G] the activation groups'
// scales, xs [T, G*32/Group] the sums of their codes per weight group) @ one panel (quad-rows
// [G*8, kQuadRow], `side` its scales).
template <int T, int Bits, int Group>
inline void TileA8(const int8_t* xq, const float* xd, const int32_t* xs, const uint8_t* panel, const Side& side,
                   int64_t G, float* out, int64_t ldo) {
  constexpr int C = kVecs;
  constexpr int64_t kRow = kQuadRow<Bits>;
  constexpr int64_t kSub = kGroup / Group;  // weight groups per activation group
  const int64_t Kp = G * kGroup, GW = G * kSub;
  Vec acc[T][C] = {};
  for (int64_t g = 0; g < G; ++g)
    for (int64_t h = 0; h < kSub; ++h) {
      IVec part[T][C] = {};
      const int64_t q0 = g * kQuads + h * (Group / 4);
      for (int64_t q = q0; q < q0 + Group / 4; ++q) {
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
      const int64_t wg = g * kSub + h;
      Vec scale[C], low[C];
      side.At(wg, 0, scale, low);
      if (side.parts == 2) {
        for (int c = 0; c < C; ++c)
          for (int t = 0; t < T; ++t)
            acc[t][c] += (ToFloat(part[t][c]) * scale[c] + Splat(static_cast<float>(xs[t * GW + wg])) * low[c]) *
                         Splat(xd[t * G + g]);
      } else {
        for (int t = 0; t < T; ++t) {
          const int32_t shift = side.offset * xs[t * GW + wg];
          const Vec d = Splat(xd[t * G + g]);
          for (int c = 0; c < C; ++c) acc[t][c] += ToFloat(part[t][c] - shift) * (scale[c] * d);
        }
      }
    }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) Store(out + t * ldo + c * kWidth, acc[t][c]);
}

using TileA8Fn = void (*)(const int8_t*, const float*, const int32_t*, const uint8_t*, const Side&, int64_t, float*,
                          int64_t);
template <int Bits, int Group>
constexpr TileA8Fn kTilesA8[kA8Tile + 1] = {nullptr, TileA8<1, Bits, Group>, TileA8<2, Bits, Group>,
                                            TileA8<3, Bits, Group>, TileA8<4, Bits, Group>};

// As `Panels`, for the rows as rounded (xq [T, G*32], xd [T, G], xs [T, G*32/Group]).
template <int Bits, int Group>
void PanelsA8(const int8_t* xq, const float* xd, const int32_t* xs, const uint8_t* wp, const SideData& side, float* y,
              int64_t T, int64_t G, int64_t N, int64_t p0, int64_t p1) {
  constexpr int64_t kSub = kGroup / Group;
  SweepPanels(y, T, N, p0, p1, kA8Tile, [=, &side](int64_t p, int64_t r, int64_t n, float* out, int64_t ldo) {
    kTilesA8<Bits, Group>[n](xq + r * G * kGroup, xd + r * G, xs + r * G * kSub, wp + p * G * kQuads * kQuadRow<Bits>,
                             side.Panel(p), G, out, ldo);
  });
}

using PanelA8Fn = void (*)(const int8_t*, const float*, const int32_t*, const uint8_t*, const SideData&, float*,
                           int64_t, int64_t, int64_t, int64_t, int64_t);

struct PickedA8 {
  PanelA8Fn fn = nullptr;
  int64_t row = 0;  // bytes per quad-row
};
struct PickA8 {
  template <int B, int G>
  PickedA8 Get() const { return {PanelsA8<B, G>, kQuadRow<B>}; }
};

inline int32_t SumLanes(IVec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_epi32((__m512i)v);
#else
  int32_t s = 0;
  for (int i = 0; i < kWidth; ++i) s += v[i];
  return s;
#endif
}

// One whole group of kGroup inputs x rounded to int8 as the scalar loop below rounds a
// partial one (d = max |x| / 127, q = x / d rounded half to even and clamped to +-127, the
// codes' sums per weight group of `group` inputs added to s), in vectors: the division is
// IEEE's in both, and adding and taking away 1.5 * 2^23 rounds |v| < 2^22 to the nearest
// integer, ties to even, as nearbyint does in the default rounding mode. Returns d. The
// scalar loop spent, per input, a 64-bit integer division (k / group, the group known only
// at run time) and a call for its thread_local buffer's address (GCC's code for a shared
// library): 3 of the 8.6 ms of SmolLM2-135M's 3-token W4A8 pass (benchmarks/real_model.md).
inline float RoundGroup(const float* x, int32_t group, int8_t* q, int32_t* s) {
  constexpr int kV = kGroup / kWidth;
  Vec v[kV], m = {};
  for (int i = 0; i < kV; ++i) {
    v[i] = Load(x + i * kWidth);
    const Vec a = v[i] < 0 ? -v[i] : v[i];
    m = a > m ? a : m;
  }
  const float d = Max(m) / 127.f;
  if (!(d > 0.f)) return d;  // codes and sums stay zero
  const Vec dv = Splat(d), magic = Splat(12582912.f), hi = Splat(127.f), lo = Splat(-127.f);
  IVec n[kV];
  for (int i = 0; i < kV; ++i) {
    Vec r = (v[i] / dv + magic) - magic;
    r = lo < r ? r : lo;  // as std::max(-127, r) then std::min(127, .): NaN becomes -127 in both
    r = r < hi ? r : hi;
    n[i] = __builtin_convertvector(r, IVec);
#if defined(__AVX512F__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kWidth), _mm512_cvtepi32_epi8((__m512i)n[i]));
#else
    for (int j = 0; j < kWidth; ++j) q[i * kWidth + j] = static_cast<int8_t>(n[i][j]);
#endif
  }
  const int per = group / kWidth;  // vectors per weight group (groups of 16 or 32 inputs)
  for (int w = 0; w < kV / per; ++w) {
    IVec t = n[w * per];
    for (int i = 1; i < per; ++i) t += n[w * per + i];
    s[w] += SumLanes(t);
  }
  return d;
}

// x [T, K] float32 times A8 panels wp [P, ceil(K/32) * 8, kQuadRow<bits>] with their scales
// and factors (GroupedSide; columns past N: any value).
ffi::Error FewRowMatmulA8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wp,
                          ffi::Buffer<ffi::F16> half, ffi::Buffer<ffi::S8> factor, ffi::ResultBuffer<ffi::F32> y,
                          int32_t bits, int32_t group, int32_t offset) {
  const PickedA8 picked = ByFormat(bits, group, PickA8{});
  if (!picked.fn) return ffi::Error::InvalidArgument(std::string("specjax_fewrow_matmul_a8: want ") + kFormats);
  auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  const bool shapes = xd.size() == 2 && wd.size() == 3 && yd.size() == 2;
  const int64_t T = shapes ? xd[0] : 0, K = shapes ? xd[1] : 0, G = (K + kGroup - 1) / kGroup;
  SideData side;
  const std::string bad =
      shapes ? GroupedSide(half.dimensions(), factor.dimensions(), wd[0], G * kGroup, group, offset,
                           reinterpret_cast<const uint16_t*>(half.typed_data()), factor.typed_data(), side)
             : "";
  if (!shapes || T < 1 || wd[1] != G * kQuads || wd[2] != picked.row || yd[0] != T || yd[1] > wd[0] * kPanel ||
      yd[1] <= (wd[0] - 1) * kPanel || !bad.empty())
    return ffi::Error::InvalidArgument(
        "specjax_fewrow_matmul_a8: want x[T, K], wp[P, ceil(K/32)*8, bytes per quad-row of the format] and y[T, N] "
        "with 64(P-1) < N <= 64P; " + (bad.empty() ? std::string("") : bad));
  const int64_t N = yd[1], P = wd[0], kSub = kGroup / group;
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
  xsv.assign(T * G * kSub, 0);
  const float* xs = x.typed_data();
  int8_t* q = xq.data();  // the buffers' addresses once (each thread_local access may be a call)
  float* d = xdv.data();
  int32_t* s = xsv.data();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
      if (k1 - k0 == kGroup) {
        d[t * G + g] = RoundGroup(xs + t * K + k0, group, q + t * Kp + k0, s + t * G * kSub + k0 / group);
        continue;
      }
      float amax = 0.f;  // a short last group
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xs[t * K + k]));
      const float dg = amax / 127.f;
      if (dg > 0.f)
        for (int64_t k = k0; k < k1; ++k) {
          const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xs[t * K + k] / dg)));
          q[t * Kp + k] = static_cast<int8_t>(v);
          s[t * G * kSub + k / group] += static_cast<int32_t>(v);
        }
      d[t * G + g] = dg;
    }
  const PanelA8Fn fn = picked.fn;
  const uint8_t* w = wp.typed_data();
  const SideData* sd = &side;
  InPasses(pool, T, Kp, K * N, P, [=](int64_t r, int64_t n, int64_t p0, int64_t p1) {
    fn(q + r * Kp, d + r * G, s + r * G * kSub, w, *sd, ys + r * N, n, G, N, p0, p1);
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
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxFewRowMatmulGrouped, FewRowMatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("offset"));

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
