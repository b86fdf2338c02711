// What both kernels share: a float vector as wide as this CPU's (GCC/Clang vector
// extensions, so one source serves AVX-512, AVX2 and anything else), and the wait for
// work handed to XLA's thread pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>

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

}  // namespace specjax
