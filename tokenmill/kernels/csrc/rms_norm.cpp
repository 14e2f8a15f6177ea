// RMSNorm fused with the residual add before it, one native call instead of ~6 torch ops.
//
// Per row: the residual stream takes x in place (a 576-float row stays in L1 between the passes),
// its squares are summed, and the normalised row goes to a fresh output. Decode rows are far too
// small to split across threads; only wide prefill batches are spread over rows.

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "simd.h"

namespace tokenmill {
namespace {

// Below this many elements a call is a few microseconds of work on one core, less than waking the
// OpenMP team costs, so decode (a handful of rows) stays on the calling thread.
constexpr int64_t kParallelMinElements = 1 << 16;

// The one loop that needs intrinsics: without -ffast-math GCC keeps a float reduction serial.
float sum_squares(const float* v, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    acc = _mm256_fmadd_ps(x, x, acc);
  }
  if (i < n) {
    const __m256 x = _mm256_maskload_ps(v + i, tail_mask(n - i));
    acc = _mm256_fmadd_ps(x, x, acc);
  }
  return horizontal_sum(acc);
}

// residual (when given) += x, then out = row * rsqrt(mean(row^2) + eps) * weight, where row is
// the updated residual or x itself.
void norm_row(const float* __restrict x, float* __restrict residual,
              const float* __restrict weight, float eps, int64_t n, float* __restrict out) {
  if (residual != nullptr)
    for (int64_t i = 0; i < n; ++i) residual[i] += x[i];
  const float* row = residual != nullptr ? residual : x;
  const float scale = 1.0f / std::sqrt(sum_squares(row, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = row[i] * scale * weight[i];
}

}  // namespace

at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "add_rms_norm: x and weight must be float32");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "add_rms_norm: weight must have x.shape[-1] elements");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat,
                "add_rms_norm: residual must be float32 with the shape of x");
    // Updated in place, so a copy would silently drop the update.
    TORCH_CHECK(residual->is_contiguous(), "add_rms_norm: residual must be contiguous");
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = dim == 0 ? 0 : xc.numel() / dim;
  const float* x_ptr = xc.data_ptr<float>();
  float* res_ptr = residual ? residual->data_ptr<float>() : nullptr;
  const float* w_ptr = wc.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
#pragma omp parallel for if (rows * dim >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r)
    norm_row(x_ptr + r * dim, res_ptr == nullptr ? nullptr : res_ptr + r * dim, w_ptr, eps_f, dim,
             out_ptr + r * dim);
  return out;
}

}  // namespace tokenmill
