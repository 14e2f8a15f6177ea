// The gated MLP's activation over the [T, 2F] output of the merged gate/up projection, in one pass
// instead of split + activation + mul (three torch dispatches and a temporary), for a float32 or
// a bfloat16 model's activations: SwiGLU's silu(gate) * up, or GeGLU's gelu_tanh(gate) * up.

#include <ATen/ATen.h>

#include <vector>

#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

// Whether rows take the 16-lane path; it gives the 8-lane path's bits, twice as many at a time.
const bool kWideRows = avx512_usable();

// Both activations are gate * sigmoid(z): silu's z is the gate itself, and tanh-GELU's
// 0.5 g (1 + tanh(u)) is g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3), so
// z = g (kGeluLinear + kGeluCubic g^2). torch's own tanh-GELU computes 1 + tanh(u), which for
// a gate below about -4 cancels to a few float32 steps of 2^-24; the sigmoid keeps those tiny
// outputs' digits (compared in the tests against float64).
constexpr float kGeluLinear = 1.5957691216057308f;   // 2 sqrt(2/pi)
constexpr float kGeluCubic = 0.071354816272922186f;  // 2 sqrt(2/pi) * 0.044715

// gate / (1 + exp(-z)) * up; a true division, not the ~12-bit reciprocal approximation. For
// bfloat16 the activation rounds to bfloat16 before the product, as torch's reference rounds
// F.silu's or F.gelu's output. Where -z is below -87.3, exp8 gives 0 and the activation is the
// gate itself.
template <GatedActivation A, typename T>
__m256 activate_mul(__m256 gate, __m256 up) {
  __m256 z = gate;
  if constexpr (A == GatedActivation::kGeluTanh)
    z = _mm256_mul_ps(gate, _mm256_fmadd_ps(_mm256_mul_ps(gate, gate), _mm256_set1_ps(kGeluCubic),
                                            _mm256_set1_ps(kGeluLinear)));
  const __m256 denom =
      _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
  return _mm256_mul_ps(Lanes<T>::rounded(_mm256_div_ps(gate, denom)), up);
}

template <GatedActivation A, typename T>
[[gnu::target("avx512f,avx512bw,avx512vl")]] __m512 activate_mul(__m512 gate, __m512 up) {
  __m512 z = gate;
  if constexpr (A == GatedActivation::kGeluTanh)
    z = _mm512_mul_ps(gate, _mm512_fmadd_ps(_mm512_mul_ps(gate, gate), _mm512_set1_ps(kGeluCubic),
                                            _mm512_set1_ps(kGeluLinear)));
  const __m512 denom =
      _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), z)));
  return _mm512_mul_ps(Lanes16<T>::rounded(_mm512_div_ps(gate, denom)), up);
}

template <GatedActivation A, typename T>
void activate_row(const T* gate, const T* up, int64_t n, T* out) {
  using L = Lanes<T>;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    L::store(out + i, activate_mul<A, T>(L::load(gate + i), L::load(up + i)));
  if (i < n)
    L::store_tail(out + i,
                  activate_mul<A, T>(L::load_tail(gate + i, n - i), L::load_tail(up + i, n - i)),
                  n - i);
}

template <GatedActivation A, typename T>
[[gnu::target("avx512f,avx512bw,avx512vl")]] void activate_row_wide(const T* gate, const T* up,
                                                                     int64_t n, T* out) {
  using L = Lanes16<T>;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    L::store(out + i, activate_mul<A, T>(L::load(gate + i), L::load(up + i)));
  if (i < n)
    L::store_tail(out + i,
                  activate_mul<A, T>(L::load_tail(gate + i, n - i), L::load_tail(up + i, n - i)),
                  n - i);
}

template <GatedActivation A, typename T>
void activate_rows(const at::Tensor& x, const at::Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1);
  const T* x_ptr = x.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x_ptr + r * 2 * width;
    if (kWideRows)
      activate_row_wide<A>(gate, gate + width, width, out_ptr + r * width);
    else
      activate_row<A>(gate, gate + width, width, out_ptr + r * width);
  }
}

template <GatedActivation A>
void activate_rows(const at::Tensor& x, const at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) return activate_rows<A, at::BFloat16>(x, out);
  activate_rows<A, float>(x, out);
}

at::Tensor activation_and_mul(const at::Tensor& x, GatedActivation activation, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": x must be float32 or bfloat16");
  TORCH_CHECK(x.size(-1) % 2 == 0, name, ": x.shape[-1] must be even (gate, then up)");
  const at::Tensor xc = x.contiguous();
  const int64_t width = x.size(-1) / 2;
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = width;
  at::Tensor out = at::empty(out_sizes, x.options());
  const int64_t rows = width == 0 ? 0 : xc.numel() / (2 * width);
  if (rows == 0) return out;
#pragma omp parallel if (rows * width >= kParallelMinElements)
  gated_activation_team(activation, xc.view({rows, 2 * width}), out.view({rows, width}));
  return out;
}

}  // namespace

void gated_activation_team(GatedActivation activation, const at::Tensor& x,
                           const at::Tensor& out) {
  if (activation == GatedActivation::kGeluTanh)
    return activate_rows<GatedActivation::kGeluTanh>(x, out);
  activate_rows<GatedActivation::kSilu>(x, out);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  return activation_and_mul(x, GatedActivation::kSilu, "silu_and_mul");
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return activation_and_mul(x, GatedActivation::kGeluTanh, "gelu_tanh_and_mul");
}

}  // namespace tokenmill
