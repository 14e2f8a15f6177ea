// Each row's index of its largest value, the first on ties, for greedy sampling straight from the
// LM head's output. A bfloat16 model's logits need no float32 copy first (widening is exact, so
// the widened row's argmax is the same), and torch's own max over a batch of LM-head rows is
// slower, more so in bfloat16. A NaN counts as larger than every number, as in torch.max: a row
// holding one gives its first NaN.

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

// Lanes of running maxima: independent chains, since one chain waits out max's latency on each
// vector.
constexpr int kChains = 4;

// Two passes over the row: its maximum (and whether it holds a NaN) eight lanes at a time, then
// the first position equal to it. The second pass reads the row from L2 and usually stops early.
template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  using L = Lanes<T>;
  __m256 top[kChains], nan[kChains];
  for (int c = 0; c < kChains; ++c) {
    top[c] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    nan[c] = _mm256_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 8 * kChains <= n; i += 8 * kChains)
    for (int c = 0; c < kChains; ++c) {
      const __m256 v = L::load(row + i + 8 * c);
      top[c] = _mm256_max_ps(top[c], v);
      nan[c] = _mm256_or_ps(nan[c], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  alignas(32) float lanes[kChains][8];
  bool has_nan = false;
  for (int c = 0; c < kChains; ++c) {
    _mm256_store_ps(lanes[c], top[c]);
    has_nan = has_nan || _mm256_movemask_ps(nan[c]) != 0;
  }
  float best = lanes[0][0];
  for (int c = 0; c < kChains; ++c)
    for (int j = 0; j < 8; ++j) best = std::max(best, lanes[c][j]);
  for (int64_t j = i; j < n; ++j) {
    const float v = static_cast<float>(row[j]);
    has_nan = has_nan || std::isnan(v);
    best = std::max(best, v);
  }
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = L::load(row + i);
    const int hits = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(hits);
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (has_nan ? std::isnan(v) : v == best) return i;
  }
  return 0;  // not reached: the row's maximum is one of its values
}

template <typename T>
void argmax_rows(const at::Tensor& x, const at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* data = x.data_ptr<T>();
  int64_t* indices = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) if (rows * n >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) indices[r] = row_argmax(data + r * n, n);
}

}  // namespace

at::Tensor row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "row_argmax: x must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) > 0, "row_argmax: x's rows must not be empty");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kBFloat16)
    argmax_rows<at::BFloat16>(xc, out);
  else
    argmax_rows<float>(xc, out);
  return out;
}

}  // namespace tokenmill
