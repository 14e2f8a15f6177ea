// The two passes around oneDNN's int8 GEMM in a W8A8 (SmoothQuant) product (ops.w8a8_linear):
//
//   quantize_tokens: fp32 x [T, K] -> uint8 codes [T, K], scales [T], zero points [T], each row
//     asymmetric over 0..255 with its range widened to hold 0: x ~ (codes - zero) * scale. One
//     read of the row for its min and max and one, while it is still in cache, for its codes;
//     the arithmetic is w8a8_linear.quantize_tokens_reference's operation for operation
//     (x times the scale's correctly rounded reciprocal, round half to even), so the two agree
//     bit for bit.
//   w8a8_rescale_: the GEMM's fp32 sums y[t, n] (already times the weight's row scale) become
//     (y - zero[t] * row_sums[n]) * scale[t] + bias[n] in place, where row_sums[n] is the weight
//     row's code sum times its scale: the zero point's share, taken off in one pass over y.
//     Each operation rounds as the reference's separate torch operations do (no fused
//     multiply-add), so these agree bit for bit too.
//
// Memory-bound element-wise passes: AVX2 on every machine.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "kernels.h"
#include "simd.h"
#include "team.h"

// The rescale must round after every operation, as the reference does: no contraction into FMA.
#pragma GCC optimize("fp-contract=off")

namespace tokenmill {
namespace {

constexpr float kMaxCode = 255.0f;
constexpr float kMinScale = 1e-12f;

// Eight codes clamp(round(x * inverse) + zero, 0, 255) as int32 lanes.
inline __m256i codes8(__m256 x, __m256 inverse, __m256 zero) {
  const __m256 steps = _mm256_round_ps(_mm256_mul_ps(x, inverse),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 code = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(steps, zero), _mm256_setzero_ps()),
                                    _mm256_set1_ps(kMaxCode));
  return _mm256_cvtps_epi32(code);
}

void quantize_row(const float* x, int64_t k, uint8_t* codes, float* scale_out, float* zero_out) {
  // Both extremes start at 0: the range always holds 0, and masked-off tail lanes read as 0.
  // Two of each, so consecutive min / max instructions do not wait on one another.
  __m256 low[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 high[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_loadu_ps(x + j + 8 * h);
      low[h] = _mm256_min_ps(low[h], v);
      high[h] = _mm256_max_ps(high[h], v);
    }
  }
  for (; j < k; j += 8) {
    const __m256 v =
        k - j >= 8 ? _mm256_loadu_ps(x + j) : _mm256_maskload_ps(x + j, tail_mask(k - j));
    low[0] = _mm256_min_ps(low[0], v);
    high[0] = _mm256_max_ps(high[0], v);
  }
  const float lo = horizontal_min(_mm256_min_ps(low[0], low[1]));
  const float hi = horizontal_max(_mm256_max_ps(high[0], high[1]));
  const float scale = std::max((hi - lo) / kMaxCode, kMinScale);
  const float zero = std::nearbyint(-lo / scale);
  const float inverse = 1.0f / scale;
  *scale_out = scale;
  *zero_out = zero;
  const __m256 inverses = _mm256_set1_ps(inverse), zeros = _mm256_set1_ps(zero);
  j = 0;
  for (; j + 32 <= k; j += 32) {
    const __m256i a = codes8(_mm256_loadu_ps(x + j), inverses, zeros);
    const __m256i b = codes8(_mm256_loadu_ps(x + j + 8), inverses, zeros);
    const __m256i c = codes8(_mm256_loadu_ps(x + j + 16), inverses, zeros);
    const __m256i d = codes8(_mm256_loadu_ps(x + j + 24), inverses, zeros);
    // The packs interleave 128-bit lanes; the permute puts the 32 codes back in order.
    const __m256i packed =
        _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    const __m256i ordered =
        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j), ordered);
  }
  for (; j < k; ++j) {
    const float code = std::min(std::max(std::nearbyint(x[j] * inverse) + zero, 0.0f), kMaxCode);
    codes[j] = static_cast<uint8_t>(code);
  }
}

void rescale_row(float* y, int64_t n, float scale, float zero, const float* row_sums,
                 const float* bias) {
  const __m256 scales = _mm256_set1_ps(scale), zeros = _mm256_set1_ps(zero);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 offset = _mm256_mul_ps(zeros, _mm256_loadu_ps(row_sums + j));
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(y + j), offset), scales);
    if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
    _mm256_storeu_ps(y + j, v);
  }
  for (; j < n; ++j) {
    const float offset = zero * row_sums[j];
    float v = (y[j] - offset) * scale;
    if (bias != nullptr) v = v + bias[j];
    y[j] = v;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_tokens(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "quantize_tokens: x must be float32 [T, K] with K > 0");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor codes = at::empty({rows, k}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({rows}, x.options());
  at::Tensor zeros = at::empty({rows}, x.options());
  const float* xp = xc.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  float* zp = zeros.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows * k >= kParallelMinElements)
  for (int64_t t = 0; t < rows; ++t) quantize_row(xp + t * k, k, cp + t * k, sp + t, zp + t);
  return {codes, scales, zeros};
}

void w8a8_rescale_(const at::Tensor& y, const at::Tensor& scales, const at::Tensor& zeros,
                   const at::Tensor& row_sums, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "w8a8_rescale_: y must be a contiguous float32 [T, N]");
  const int64_t rows = y.size(0), n = y.size(1);
  auto check_vector = [](const at::Tensor& t, int64_t size, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.size(0) == size,
                "w8a8_rescale_: ", name, " must be a contiguous float32 [", size, "]");
  };
  check_vector(scales, rows, "scales");
  check_vector(zeros, rows, "zeros");
  check_vector(row_sums, n, "row_sums");
  if (bias.has_value()) check_vector(*bias, n, "bias");
  float* yp = y.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  const float* rp = row_sums.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
#pragma omp parallel for schedule(static) if (rows * n >= kParallelMinElements)
  for (int64_t t = 0; t < rows; ++t) rescale_row(yp + t * n, n, sp[t], zp[t], rp, bp);
}

}  // namespace tokenmill
