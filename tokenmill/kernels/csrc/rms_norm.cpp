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

// residual (when given) += x, then out = row * rsqrt(mean(row^2) + eps) * weight, where row is
// the updated residual or x itself. A bfloat16 row is worked on in float32 and each result rounds
// once, where torch's reference rounds them: the sum as it joins the residual stream (`add_`),
// the output after the weight (torch's rms_norm multiplies in float32 and rounds at the end).
template <typename T>
void norm_row(const T* __restrict x, T* __restrict residual, const T* __restrict weight,
              float eps, int64_t n, T* __restrict out) {
  using L = Lanes<T>;
  const int64_t whole = n / 8 * 8, tail = n - whole;
  if (residual != nullptr) {
    for (int64_t i = 0; i < whole; i += 8)
      L::store(residual + i, _mm256_add_ps(L::load(residual + i), L::load(x + i)));
    if (tail > 0) {
      const __m256 sum =
          _mm256_add_ps(L::load_tail(residual + whole, tail), L::load_tail(x + whole, tail));
      L::store_tail(residual + whole, sum, tail);
    }
  }
  const T* row = residual != nullptr ? residual : x;
  // Without -ffast-math GCC keeps a float reduction serial, hence the explicit lanes.
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = L::load(row + i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  if (tail > 0) {
    const __m256 v = L::load_tail(row + whole, tail);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const float scale = 1.0f / std::sqrt(horizontal_sum(squares) / static_cast<float>(n) + eps);
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < whole; i += 8)
    L::store(out + i, _mm256_mul_ps(_mm256_mul_ps(L::load(row + i), s), L::load(weight + i)));
  if (tail > 0)
    L::store_tail(out + whole,
                  _mm256_mul_ps(_mm256_mul_ps(L::load_tail(row + whole, tail), s),
                                L::load_tail(weight + whole, tail)),
                  tail);
}

// Whether rows take the 16-lane path below, which gives norm_row's bits.
const bool kWideRows = avx512_usable();

// squares + lo(v)^2, then + hi(v)^2: norm_row's 8-lane sum of squares, in its order.
[[gnu::target("avx512f,avx512dq")]] __m256 add_squares(__m256 squares, __m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v), hi = _mm512_extractf32x8_ps(v, 1);
  return _mm256_fmadd_ps(hi, hi, _mm256_fmadd_ps(lo, lo, squares));
}

// norm_row 16 lanes at a time. The sum of squares stays in 8 lanes so the scale, and with it
// every output, is the same on both paths.
template <typename T>
[[gnu::target("avx512f,avx512dq,avx512bw,avx512vl")]] void norm_row_wide(
    const T* __restrict x, T* __restrict residual, const T* __restrict weight, float eps,
    int64_t n, T* __restrict out) {
  using L = Lanes16<T>;
  const int64_t whole = n / 16 * 16, tail = n - whole;
  if (residual != nullptr) {
    for (int64_t i = 0; i < whole; i += 16)
      L::store(residual + i, _mm512_add_ps(L::load(residual + i), L::load(x + i)));
    if (tail > 0) {
      const __m512 sum =
          _mm512_add_ps(L::load_tail(residual + whole, tail), L::load_tail(x + whole, tail));
      L::store_tail(residual + whole, sum, tail);
    }
  }
  const T* row = residual != nullptr ? residual : x;
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 16) squares = add_squares(squares, L::load(row + i));
  if (tail > 0) squares = add_squares(squares, L::load_tail(row + whole, tail));
  const float scale = 1.0f / std::sqrt(horizontal_sum(squares) / static_cast<float>(n) + eps);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < whole; i += 16)
    L::store(out + i, _mm512_mul_ps(_mm512_mul_ps(L::load(row + i), s), L::load(weight + i)));
  if (tail > 0)
    L::store_tail(out + whole,
                  _mm512_mul_ps(_mm512_mul_ps(L::load_tail(row + whole, tail), s),
                                L::load_tail(weight + whole, tail)),
                  tail);
}

// x's rows, T being float or at::BFloat16: x [rows, d] or [T, heads, d] (each row contiguous,
// any token stride), the residual and the output [rows, d], and the weight [d], all of one type.
template <typename T>
void norm_rows(const at::Tensor& x, T* residual, const at::Tensor& weight, float eps,
               const at::Tensor& out) {
  const int64_t dim = x.size(-1);
  const int64_t per_token = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.size(0) * per_token, token_stride = x.stride(0);
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x_row = x_ptr + r / per_token * token_stride + r % per_token * dim;
    T* residual_row = residual == nullptr ? nullptr : residual + r * dim;
    if (kWideRows)
      norm_row_wide(x_row, residual_row, w_ptr, eps, dim, out_ptr + r * dim);
    else
      norm_row(x_row, residual_row, w_ptr, eps, dim, out_ptr + r * dim);
  }
}

}  // namespace

void add_rms_norm_team(const at::Tensor& x, void* residual, const at::Tensor& weight, float eps,
                       const at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16)
    return norm_rows(x, static_cast<at::BFloat16*>(residual), weight, eps, out);
  norm_rows(x, static_cast<float*>(residual), weight, eps, out);
}

at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() >= 1 && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  weight.scalar_type() == dtype,
              "add_rms_norm: x and weight must be both float32 or both bfloat16");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "add_rms_norm: weight must have x.shape[-1] elements");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == dtype,
                "add_rms_norm: residual must have the shape and dtype of x");
    // Updated in place, so a copy would silently drop the update.
    TORCH_CHECK(residual->is_contiguous(), "add_rms_norm: residual must be contiguous");
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = dim == 0 ? 0 : xc.numel() / dim;
  if (rows == 0) return out;
  void* res_ptr = residual ? residual->data_ptr() : nullptr;
#pragma omp parallel if (rows * dim >= kParallelMinElements)
  add_rms_norm_team(xc.view({rows, dim}), res_ptr, wc, static_cast<float>(eps), out);
  return out;
}

}  // namespace tokenmill
