// RMSNorm fused with the residual add before it, one native call instead of ~6 torch ops.
//
// Per row: the residual stream takes x in place (a 576-float row stays in L1 between the passes),
// its squares are summed, and the normalised row goes to a fresh output. On its own a call opens a
// parallel region only for wide prefill batches: decode rows are far too small to be worth waking
// a second thread.

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "simd.h"
#include "team.h"

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

void add_rms_norm_team(const at::Tensor& x, float* residual, const at::Tensor& weight, float eps,
                       const at::Tensor& out) {
  const int64_t dim = x.size(-1);
  const int64_t per_token = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.size(0) * per_token, token_stride = x.stride(0);
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    norm_row(x_ptr + r / per_token * token_stride + r % per_token * dim,
             residual == nullptr ? nullptr : residual + r * dim, w_ptr, eps, dim,
             out_ptr + r * dim);
}

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
  if (rows == 0) return out;
  float* res_ptr = residual ? residual->data_ptr<float>() : nullptr;
#pragma omp parallel if (rows * dim >= kParallelMinElements)
  add_rms_norm_team(xc.view({rows, dim}), res_ptr, wc, static_cast<float>(eps), out);
  return out;
}

}  // namespace tokenmill
