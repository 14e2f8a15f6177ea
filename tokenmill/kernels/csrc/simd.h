// AVX2 helpers shared by the kernels: a lane mask for row tails and a horizontal sum.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

// Lanes [0, n) set. Masked loads read nothing past the end of a row, so a row whose length is
// not a multiple of 8 takes the same FMA path as the rest instead of a scalar epilogue.
inline __m256i tail_mask(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
}

inline float horizontal_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

}  // namespace tokenmill
