// SwiGLU's activation, silu(gate) * up over the [T, 2F] output of the merged gate/up projection,
// in one pass instead of split + silu + mul (three torch dispatches and a temporary), for a
// float32 or a bfloat16 model's activations.

#include <ATen/ATen.h>

#include <vector>

#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

// Below this many outputs the work is a few microseconds, less than waking the OpenMP team, so
// decode stays on the calling thread.
constexpr int64_t kParallelMinElements = 1 << 16;

// exp(x) to about 2 ulp (Cephes' expf): x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7
// polynomial, 2^n put straight into the exponent bits. std::exp per element would cost more
// than the torch dispatch this kernel removes (F = 1536 per decode row).
__m256 exp256(__m256 x) {
  // Outside this range expf is 0 or inf anyway; clamping keeps n inside the exponent field.
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  // ln2 in two parts so n * ln2 is subtracted without rounding away r's low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

// gate / (1 + exp(-gate)) * up, torch's own formula for silu; a true division, not the ~12-bit
// reciprocal approximation. For bfloat16, silu(gate) rounds to bfloat16 before the product, as
// torch's reference rounds its F.silu output.
template <typename T>
__m256 silu_mul(__m256 gate, __m256 up) {
  const __m256 minus_gate = _mm256_sub_ps(_mm256_setzero_ps(), gate);
  const __m256 denom = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(minus_gate));
  return _mm256_mul_ps(Lanes<T>::rounded(_mm256_div_ps(gate, denom)), up);
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, int64_t n, T* out) {
  using L = Lanes<T>;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) L::store(out + i, silu_mul<T>(L::load(gate + i), L::load(up + i)));
  if (i < n)
    L::store_tail(out + i, silu_mul<T>(L::load_tail(gate + i, n - i), L::load_tail(up + i, n - i)),
                  n - i);
}

template <typename T>
void silu_mul_rows(const at::Tensor& x, const at::Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1);
  const T* x_ptr = x.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x_ptr + r * 2 * width;
    silu_mul_row(gate, gate + width, width, out_ptr + r * width);
  }
}

}  // namespace

void silu_and_mul_team(const at::Tensor& x, const at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) return silu_mul_rows<at::BFloat16>(x, out);
  silu_mul_rows<float>(x, out);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "silu_and_mul: x must be float32 or bfloat16");
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_and_mul: x.shape[-1] must be even (gate, then up)");
  const at::Tensor xc = x.contiguous();
  const int64_t width = x.size(-1) / 2;
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = width;
  at::Tensor out = at::empty(out_sizes, x.options());
  const int64_t rows = width == 0 ? 0 : xc.numel() / (2 * width);
  if (rows == 0) return out;
#pragma omp parallel if (rows * width >= kParallelMinElements)
  silu_and_mul_team(xc.view({rows, 2 * width}), out.view({rows, width}));
  return out;
}

}  // namespace tokenmill
