// What both kernels share: a float vector as wide as this CPU's (GCC/Clang vector
// extensions, so one source serves AVX-512, AVX2 and anything else), and the wait for
// work handed to XLA's thread pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specjax {

#if defined(__AVX512F__)
constexpr int kWidth = 16;
#else
constexpr int kWidth = 8;
#endif
typedef float Vec __attribute__((vector_size(kWidth * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kWidth * sizeof(int32_t))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline Vec Splat(float s) {
#if defined(__AVX512F__)
  return (Vec)_mm512_set1_ps(s);
#elif defined(__AVX__)
  return (Vec)_mm256_set1_ps(s);
#else
  Vec v;
  for (int i = 0; i < kWidth; ++i) v[i] = s;
  return v;
#endif
}
// The largest of a vector's lanes (no NaN among them): AVX-512's tree of shuffles; a
// lane-by-lane loop is a chain of dependent maximums, as long as the A8 kernel's rounding
// of the group it serves.
inline float Max(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0];
  for (int i = 1; i < kWidth; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}
// The sum of a vector's lanes as a tree of halves (a lane-by-lane loop is a chain of
// dependent scalar adds, which dominated the attention kernel's dot products).
inline float Sum(Vec v) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
  typedef float Half __attribute__((vector_size(32)));
  typedef float Quarter __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const Half h = v;
#endif
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
#else
  float s = 0.f;
  for (int i = 0; i < kWidth; ++i) s += v[i];
  return s;
#endif
}

// The lane sums of four vectors, each summed in exactly Sum's order (so a dot product is
// the same float whether its key was scored alone or in a group of four), with the
// levels of the tree shared between the four: a third of Sum's shuffles and adds each.
inline void Sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
#if defined(__AVX512F__)
  const Vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const Vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // Lanes 4i..4i+3: vector i's four quarter sums, as Sum's `q`.
  const Vec q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const Vec y = q + __builtin_shufflevector(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  for (int i = 0; i < 4; ++i) out[i] = y[4 * i] + y[4 * i + 1];  // (q0 + q2) + (q1 + q3)
#else
  const Vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const Vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  // Lanes 2i, 2i+1: vector i's (q0 + q2, q1 + q3).
  const Vec y = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int i = 0; i < 4; ++i) out[i] = y[2 * i] + y[2 * i + 1];
#endif
#else
  out[0] = Sum(a);
  out[1] = Sum(b);
  out[2] = Sum(c);
  out[3] = Sum(d);
#endif
}

// Waits until `done` reaches `total` (the pieces other threads have taken): spins, as
// they are short, then yields, so that on a busy machine a preempted helper can get its
// core back.
template <typename Int>
inline void WaitFor(const std::atomic<Int>& done, Int total) {
  for (int spins = 0; done.load(std::memory_order_acquire) < total; ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

// Calls fn(i) for every i in [0, items) on the calling thread and up to `helpers` of the
// pool's threads, each item taken by whichever thread comes first: the calling thread
// never waits for a task that has not started, so a busy pool cannot stall it. Returns
// when every item is done; a helper that starts later finds nothing left (the state it
// shares is kept alive for it).
template <typename Pool, typename Fn>
void ParallelFor(Pool& pool, int64_t items, int64_t helpers, Fn fn) {
  struct State {
    State(Fn f, int64_t n) : fn(std::move(f)), items(n) {}
    Fn fn;
    int64_t items;
    std::atomic<int64_t> next{0}, done{0};
    void Work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(fn), items);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->Work(); });
  state->Work();
  WaitFor(state->done, items);
}

}  // namespace specjax
