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
inline float Sum(Vec v) {
  float s = 0.f;
  for (int i = 0; i < kWidth; ++i) s += v[i];
  return s;
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
