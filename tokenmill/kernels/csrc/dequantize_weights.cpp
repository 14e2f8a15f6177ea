// int8 / int4 block weights (the row-major layouts quant_panels.py describes) and fp8 e4m3 weights
// with a scale per row back to fp32 [N, K].
//
// For wide x (prefill, big batches) torch's blocked GEMM beats streaming the quantized weights
// once per chunk of rows, so the weight is expanded to fp32 first; this does it in one parallel
// pass instead of the several full-size temporaries the torch reference makes.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "fp8.h"
#include "kquant.h"
#include "quant.h"

namespace tokenmill {
namespace {

// Writes the first `valid` of 32 values (scale * q[v] + offset) to out.
inline void store_block(const __m256i (&q32)[4], float scale, float offset, float* out,
                        int64_t valid) {
  alignas(32) float block[kQuantBlock];
  float* dst = valid >= kQuantBlock ? out : block;
  const __m256 d = _mm256_set1_ps(scale), m = _mm256_set1_ps(offset);
  for (int c = 0; c < 4; ++c)
    _mm256_storeu_ps(dst + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q32[c]), d, m));
  if (dst == block) std::copy_n(block, valid, out);
}

// The 32 values of block b of a packed row, one per byte (unsigned for int4).
template <bool Int4>
inline __m256i block_values(const uint8_t* row, int64_t b) {
  if constexpr (Int4) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b / 2 * 32));
    const __m256i nibbles = b % 2 ? _mm256_srli_epi16(packed, 4) : packed;
    return _mm256_and_si256(nibbles, _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kQuantBlock));
  }
}

template <typename Scale, bool Int4>
void dequantize_rows(const uint8_t* values, int64_t row_bytes, const Scale* scales,
                     const Scale* mins, float* out, int64_t n, int64_t k, int64_t groups,
                     int64_t blocks_per_group) {
  const int64_t blocks = (k + kQuantBlock - 1) / kQuantBlock;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = b / blocks_per_group;
      const __m256i q = block_values<Int4>(values + row * row_bytes, b);
      const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      __m256i q32[4];
      for (int c = 0; c < 4; ++c) {
        const __m128i eight = c % 2 ? _mm_srli_si128(halves[c / 2], 8) : halves[c / 2];
        q32[c] = Int4 ? _mm256_cvtepu8_epi32(eight) : _mm256_cvtepi8_epi32(eight);
      }
      const float offset = Int4 ? to_float(mins[row * groups + g]) : 0.0f;
      store_block(q32, to_float(scales[row * groups + g]), offset, out + row * k + b * kQuantBlock,
                  k - b * kQuantBlock);
    }
  }
}

template <bool Int4>
at::Tensor dequantize(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t group_size, int64_t k) {
  TORCH_CHECK(k > 0, op, ": in_features must be > 0");
  const int64_t row_bytes = packed_row_bytes(k, Int4);
  std::vector<at::Tensor> per_group{scales};
  if (mins.has_value()) per_group.push_back(*mins);
  check_packed_weight(op, qweight, Int4 ? at::kByte : at::kChar, row_bytes, per_group, k,
                      group_size);
  const int64_t n = qweight.size(0);
  at::Tensor out = at::empty({n, k}, scales.options().dtype(at::kFloat));
  with_scale_type(scales, [&](auto scale_type) {
    using Scale = std::remove_const_t<std::remove_pointer_t<decltype(scale_type)>>;
    dequantize_rows<Scale, Int4>(static_cast<const uint8_t*>(qweight.data_ptr()), row_bytes,
                                 scales.data_ptr<Scale>(),
                                 Int4 ? mins->data_ptr<Scale>() : nullptr, out.data_ptr<float>(),
                                 n, k, scales.size(1), group_size / kQuantBlock);
    return 0;
  });
  return out;
}

}  // namespace

at::Tensor dequantize_int8(const at::Tensor& qweight, const at::Tensor& scales,
                           int64_t group_size, int64_t in_features) {
  return dequantize<false>("dequantize_int8", qweight, scales, std::nullopt, group_size,
                           in_features);
}

at::Tensor dequantize_int4(const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t group_size, int64_t in_features) {
  return dequantize<true>("dequantize_int4", qweight, scales, mins, group_size, in_features);
}

at::Tensor dequantize_q5_0(const at::Tensor& qweight, const at::Tensor& qhigh,
                           const at::Tensor& scales, int64_t group_size, int64_t k) {
  const char* op = "dequantize_q5_0";
  TORCH_CHECK(k > 0, op, ": in_features must be > 0");
  TORCH_CHECK(group_size == kQuantBlock, op, ": Q5_0 blocks are groups of 32, got ", group_size);
  TORCH_CHECK(scales.scalar_type() == at::kHalf, op, ": scales must be float16");
  check_packed_weight(op, qweight, at::kByte, packed_row_bytes(k, true), {scales}, k, group_size);
  const int64_t n = qweight.size(0), blocks = (k + kQuantBlock - 1) / kQuantBlock;
  TORCH_CHECK(qhigh.scalar_type() == at::kByte && qhigh.is_contiguous() && qhigh.dim() == 2 &&
                  qhigh.size(0) == n && qhigh.size(1) == blocks * 4,
              op, ": qhigh must be contiguous uint8 [", n, ", ", blocks * 4, "]");
  at::Tensor out = at::empty({n, k}, scales.options().dtype(at::kFloat));
  const auto* values = qweight.data_ptr<uint8_t>();
  const auto* high = qhigh.data_ptr<uint8_t>();
  const auto* d = scales.data_ptr<at::Half>();
  float* dst = out.data_ptr<float>();
  const int64_t row_bytes = qweight.size(1);
  // Byte i of a vector picks byte i / 8 of the 32 fifth bits, then tests its bit i % 8.
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                            0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t bits;
      std::memcpy(&bits, high + (row * blocks + b) * 4, sizeof(bits));
      const __m256i chosen = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread),
                                              bit);
      const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(chosen, bit),
                                             _mm256_set1_epi8(0x10));
      // q - 16 in -16..15: the products d * (q - 16) then round as gguf.quants' do.
      const __m256i q = _mm256_sub_epi8(
          _mm256_or_si256(block_values<true>(values + row * row_bytes, b), fifth),
          _mm256_set1_epi8(16));
      const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      __m256i q32[4];
      for (int c = 0; c < 4; ++c)
        q32[c] = _mm256_cvtepi8_epi32(c % 2 ? _mm_srli_si128(halves[c / 2], 8) : halves[c / 2]);
      // Adding -0 keeps every product's bits, a -0 (a zero code times a negative d) included.
      store_block(q32, to_float(d[row * blocks + b]), -0.0f, dst + row * k + b * kQuantBlock,
                  k - b * kQuantBlock);
    }
  }
  return out;
}

at::Tensor dequantize_fp8(const at::Tensor& qweight, const at::Tensor& scales) {
  check_fp8_weight("dequantize_fp8", qweight, scales);
  const int64_t n = qweight.size(0), k = qweight.size(1);
  at::Tensor out = at::empty({n, k}, scales.options());
  const auto* codes = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* row_scales = scales.data_ptr<float>();
  float* dst = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < n; ++row) {
    const uint8_t* src = codes + row * k;
    float* y = dst + row * k;
    const float scale = row_scales[row] * kFp8DecodeScale;
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(fp8x8_scaled(src + i), s));
    for (; i < k; ++i) y[i] = fp8_scaled(src[i]) * scale;
  }
  return out;
}

}  // namespace tokenmill
