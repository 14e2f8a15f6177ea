// AVX2 helpers shared by the kernels: lane masks for row tails, horizontal sums, exp, and rows of
// float32 or bfloat16 seen as float lanes (Lanes<T>); and for the AVX-512 paths, the check that
// picks them and a bfloat16 widening.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace tokenmill {

// Whether a kernel path that an environment switch can turn off is on: unset or anything but
// "0" leaves it on; "0" gives the baseline it is measured against.
inline bool switch_on(const char* name) {
  const char* setting = std::getenv(name);
  return setting == nullptr || std::strcmp(setting, "0") != 0;
}

// Whether kernels may take their AVX-512 paths where the CPU has them: TOKENMILL_AVX512=0 keeps
// every kernel on AVX2, the baseline those paths are measured against (outputs are the same).
inline bool avx512_allowed() { return switch_on("TOKENMILL_AVX512"); }

// Whether a kernel may take its AVX-512 path: TOKENMILL_AVX512 allows it and the CPU has
// AVX-512 F, DQ, BW and VL (and VNNI, when `vnni`). __builtin_cpu_init first: the kernels ask
// while the library loads, possibly before libgcc's own initializer has read the CPU.
inline bool avx512_usable(bool vnni = false) {
  __builtin_cpu_init();
  return avx512_allowed() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && (!vnni || __builtin_cpu_supports("avx512vnni"));
}

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

inline float horizontal_min(__m256 v) {
  __m128 half = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_min_ps(half, _mm_movehl_ps(half, half));
  half = _mm_min_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

inline float horizontal_max(__m256 v) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// Eight bfloat16 values (bit patterns in 8 uint16 lanes) as floats, exactly: a bfloat16 is the
// top half of a float's bits.
inline __m256 widened_bfloat16x8(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 bfloat16x8(const uint16_t* p) {
  return widened_bfloat16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Sixteen bfloat16 values as floats, exactly, for the AVX-512 paths.
[[gnu::target("avx512f")]] inline __m512 bfloat16x16(const uint16_t* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Four float sums of 8 lanes each as the four lanes of one vector: three horizontal adds reduce
// all four at once, where four separate reductions take four times the shuffles.
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  // [a0 a1 a2 a3] per 128-bit half, then the halves added.
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Eight floats rounded to bfloat16 (to nearest, ties to even; NaN to the quiet NaN c10 makes),
// as the low 16 bits of each lane packed into 8 uint16.
inline __m128i round_bfloat16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}

// Rows of T (float, or at::BFloat16) seen as floats 8 lanes at a time, for the kernels that run
// both a float32 and a bfloat16 model's activations: loads widen exactly, stores round to
// nearest even as torch does, and the tail forms touch only the first n < 8 elements.
// `rounded` is a float as T would hold it, for the places where torch rounds an intermediate.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load_tail(const float* p, int64_t n) {
    return _mm256_maskload_ps(p, tail_mask(n));
  }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static void store_tail(float* p, __m256 v, int64_t n) {
    _mm256_maskstore_ps(p, tail_mask(n), v);
  }
  static __m256 rounded(__m256 v) { return v; }
};

template <>
struct Lanes<c10::BFloat16> {
  static const uint16_t* bits(const c10::BFloat16* p) {
    return reinterpret_cast<const uint16_t*>(p);
  }
  static __m256 load(const c10::BFloat16* p) { return bfloat16x8(bits(p)); }
  static __m256 load_tail(const c10::BFloat16* p, int64_t n) {
    uint16_t padded[8] = {};
    std::memcpy(padded, p, n * sizeof(uint16_t));
    return bfloat16x8(padded);
  }
  static void store(c10::BFloat16* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bfloat16x8(v));
  }
  static void store_tail(c10::BFloat16* p, __m256 v, int64_t n) {
    uint16_t padded[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(padded), round_bfloat16x8(v));
    std::memcpy(p, padded, n * sizeof(uint16_t));
  }
  static __m256 rounded(__m256 v) { return widened_bfloat16x8(round_bfloat16x8(v)); }
};

// e^x in 8 lanes (Cephes' single-precision method: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for e^r, 2^n built in the exponent bits); about 1e-7 relative error. Inputs below
// -87.3 give 0, never a denormal: attention multiplies these weights by a quantized cache's
// token scales, and products that came out denormal took a microcode assist each (an int8 cache
// whose scores spanned hundreds ran many times slower). No softmax sum notices e^-87.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3f);
  const __m256 representable = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lowest), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts, so n * ln2_high is exact and r keeps its low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e_r = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(e_r, _mm256_castsi256_ps(two_n)), representable);
}

// The AVX-512 twins of the above for element-wise kernels, 16 lanes at a time. Each does its
// AVX2 twin's arithmetic lane for lane, so a kernel's two paths give the same bits.

// exp8 in 16 lanes.
[[gnu::target("avx512f")]] inline __m512 exp16(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.3f);
  const __mmask16 representable = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lowest), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e_r =
      _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i two_n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(representable, e_r, _mm512_castsi512_ps(two_n));
}

// round_bfloat16x8's rounding in 16 lanes, each result left in the top half of its float: the
// bfloat16 value itself, as a float.
[[gnu::target("avx512f")]] inline __m512i rounded_bfloat16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i top = _mm512_and_si512(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
      _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(top, nan, _mm512_set1_epi32(0x7fc00000));
}

// Lanes<T> 16 at a time; the tail forms touch only the first n < 16 elements.
template <typename T>
struct Lanes16;

template <>
struct Lanes16<float> {
  [[gnu::target("avx512f")]] static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  [[gnu::target("avx512f")]] static __m512 load_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  [[gnu::target("avx512f")]] static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  [[gnu::target("avx512f")]] static void store_tail(float* p, __m512 v, int64_t n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
  [[gnu::target("avx512f")]] static __m512 rounded(__m512 v) { return v; }
};

template <>
struct Lanes16<c10::BFloat16> {
  [[gnu::target("avx512f")]] static __m512 load(const c10::BFloat16* p) {
    return bfloat16x16(reinterpret_cast<const uint16_t*>(p));
  }
  [[gnu::target("avx512f,avx512bw,avx512vl")]] static __m512 load_tail(const c10::BFloat16* p,
                                                                         int64_t n) {
    const __m256i bits = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  [[gnu::target("avx512f")]] static void store(c10::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded_bfloat16_bits(v), 16)));
  }
  [[gnu::target("avx512f,avx512bw,avx512vl")]] static void store_tail(c10::BFloat16* p, __m512 v,
                                                                        int64_t n) {
    const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded_bfloat16_bits(v), 16));
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), bits);
  }
  [[gnu::target("avx512f")]] static __m512 rounded(__m512 v) {
    return _mm512_castsi512_ps(rounded_bfloat16_bits(v));
  }
};

}  // namespace tokenmill
