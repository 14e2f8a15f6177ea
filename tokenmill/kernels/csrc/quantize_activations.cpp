// fp32 activation rows -> int8 or int16 blocks of 32 with one fp32 scale each (QuantizedRows).
//
// The quantized-weight kernels multiply in integers, so the activations become integers here,
// once per call, before the weights stream. The arithmetic is exactly that of
// ops.quantize_activations_reference (scale max|x| / L, values round-half-even(x * (L / max|x|))
// with L = 127 or 32767), so the tests compare the two bit for bit.

#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "quant.h"
#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

inline int32_t horizontal_sum_i32(__m256i v) {
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  half = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 1));
  return _mm_cvtsi128_si32(half);
}

// Stores 32 int32 values (already within T's range) as T, in order.
inline void store_values(const __m256i (&ints)[4], int8_t* q) {
  // The packs interleave 128-bit lanes; the permute puts the 32 values back in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                            _mm256_packs_epi32(ints[2], ints[3]));
  const __m256i ordered =
      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
}

inline void store_values(const __m256i (&ints)[4], int16_t* q) {
  for (int half = 0; half < 2; ++half) {
    const __m256i packed = _mm256_packs_epi32(ints[2 * half], ints[2 * half + 1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * half),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
}

// x[0, valid) into one block of 32 values (zeros past `valid`).
template <typename T>
void quantize_block(const float* x, int64_t valid, T* q, float* scale, float* sum) {
  constexpr float kLimit = QuantizedRows<T>::kLimit;
  __m256 v[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t left = valid - 8 * c;
    if (left >= 8) {
      v[c] = _mm256_loadu_ps(x + 8 * c);
    } else if (left > 0) {
      v[c] = _mm256_maskload_ps(x + 8 * c, tail_mask(left));
    } else {
      v[c] = _mm256_setzero_ps();
    }
  }
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 max_abs = _mm256_andnot_ps(sign_bit, v[0]);
  for (int c = 1; c < 4; ++c) max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign_bit, v[c]));
  const float amax = horizontal_max(max_abs);
  const __m256 inverse = _mm256_set1_ps(amax != 0.0f ? kLimit / amax : 0.0f);
  __m256i ints[4];
  for (int c = 0; c < 4; ++c) {
    const __m256 scaled = _mm256_mul_ps(v[c], inverse);
    ints[c] = _mm256_cvtps_epi32(
        _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const int32_t total = horizontal_sum_i32(
      _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3])));
  store_values(ints, q);
  *scale = amax / kLimit;
  *sum = *scale * static_cast<float>(total);
}

}  // namespace

template <typename T>
void QuantizedRows<T>::quantize(const float* x, int64_t rows, int64_t k) {
#pragma omp for schedule(static)
  for (int64_t index = 0; index < rows * blocks_; ++index) {
    const int64_t i = index / blocks_, b = index % blocks_;
    quantize_block(x + i * k + b * kQuantBlock, k - b * kQuantBlock,
                   values_ + index * kQuantBlock, scales_ + index, sums_ + index);
  }
}

template class QuantizedRows<int8_t>;
template class QuantizedRows<int16_t>;

namespace {

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantized_tensors(const at::Tensor& x,
                                                                 at::ScalarType dtype) {
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), blocks = (k + kQuantBlock - 1) / kQuantBlock;
  std::vector<float> storage(
      (QuantizedRows<T>::storage_bytes(rows, blocks) + sizeof(float) - 1) / sizeof(float));
  QuantizedRows<T> quantized(storage.data(), rows, blocks);
#pragma omp parallel if (rows * k >= kParallelMinElements)
  quantized.quantize(xc.data_ptr<float>(), rows, k);
  at::Tensor values = at::empty({rows, blocks * kQuantBlock}, x.options().dtype(dtype));
  at::Tensor scales = at::empty({rows, blocks}, x.options());
  at::Tensor sums = at::empty({rows, blocks}, x.options());
  std::copy_n(quantized.values(0), rows * blocks * kQuantBlock, static_cast<T*>(values.data_ptr()));
  std::copy_n(quantized.scales(0), rows * blocks, scales.data_ptr<float>());
  std::copy_n(quantized.sums(0), rows * blocks, sums.data_ptr<float>());
  return {values, scales, sums};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x,
                                                                    int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "quantize_activations: x must be float32 [M, K]");
  TORCH_CHECK(bits == 8 || bits == 16, "quantize_activations: bits must be 8 or 16");
  return bits == 8 ? quantized_tensors<int8_t>(x, at::kChar)
                   : quantized_tensors<int16_t>(x, at::kShort);
}

}  // namespace tokenmill
