// fp8 e4m3 bytes to fp32 without a lookup table, for the fp8 weight kernels and the fp8 KV
// cache.
//
// e4m3 bits s eeee mmm, sign-extended to 16 bits and shifted left by 7, are fp16's
// s eeeee mmmmmmmmmm with a stray copy of s in the top exponent bit; clearing it leaves an fp16
// equal to the e4m3 value times 2^-8 (fp16's exponent bias is 15, e4m3's 7), subnormals
// included: e4m3's subnormals land on fp16's, which F16C converts exactly. NaN codes (0x7f,
// 0xff) decode as 480 * 2^-8 instead; tokenmill's quantizers never write them.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

// What the decoded values must be multiplied by to be the e4m3 values (exact: a power of 2).
constexpr float kFp8DecodeScale = 256.0f;

// Eight e4m3 codes as fp32, each times 2^-8.
inline __m256 fp8x8_scaled(const uint8_t* p) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7);
  return _mm256_cvtph_ps(_mm_andnot_si128(_mm_set1_epi16(0x4000), shifted));
}

// Sixteen e4m3 codes as fp32, each times 2^-8, for the AVX-512 paths.
[[gnu::target("avx512f,avx512bw,avx512vl")]] inline __m512 fp8x16_scaled(const uint8_t* p) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
  return _mm512_cvtph_ps(_mm256_andnot_si256(_mm256_set1_epi16(0x4000), shifted));
}

// One e4m3 code as fp32, times 2^-8.
inline float fp8_scaled(uint8_t code) {
  const auto bits = static_cast<uint16_t>(static_cast<int16_t>(static_cast<int8_t>(code)) << 7);
  return _cvtsh_ss(static_cast<uint16_t>(bits & ~0x4000));
}

}  // namespace tokenmill
