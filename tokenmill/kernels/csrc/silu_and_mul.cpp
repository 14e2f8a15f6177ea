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

// Whether rows take the 16-lane path; it gives the 8-lane path's bits, twice as many at a time.
const bool kWideRows = avx512_usable();

// gate / (1 + exp(-gate)) * up, torch's own formula for silu; a true division, not the ~12-bit
// reciprocal approximation. For bfloat16, silu(gate) rounds to bfloat16 before the product, as
// torch's reference rounds its F.silu output. A gate past 87.3 gets exp8's 0: silu(gate) = gate.
template <typename T>
__m256 silu_mul(__m256 gate, __m256 up) {
  const __m256 minus_gate = _mm256_sub_ps(_mm256_setzero_ps(), gate);
  const __m256 denom = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(minus_gate));
  return _mm256_mul_ps(Lanes<T>::rounded(_mm256_div_ps(gate, denom)), up);
}

template <typename T>
[[gnu::target("avx512f,avx512bw,avx512vl")]] __m512 silu_mul(__m512 gate, __m512 up) {
  const __m512 minus_gate = _mm512_sub_ps(_mm512_setzero_ps(), gate);
  const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(minus_gate));
  return _mm512_mul_ps(Lanes16<T>::rounded(_mm512_div_ps(gate, denom)), up);
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
[[gnu::target("avx512f,avx512bw,avx512vl")]] void silu_mul_row_wide(const T* gate, const T* up,
                                                                     int64_t n, T* out) {
  using L = Lanes16<T>;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    L::store(out + i, silu_mul<T>(L::load(gate + i), L::load(up + i)));
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
    if (kWideRows)
      silu_mul_row_wide(gate, gate + width, width, out_ptr + r * width);
    else
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
