// Skinny fp32 linear, y = x W^T + b, for decode-sized batches (a handful of rows of x).
//
// With M <= 16 rows of x each weight is used at most M times, so at M = 1 the product is one
// pass over W and its speed is DRAM bandwidth, not arithmetic. The kernel streams W exactly
// once, in order: a static OpenMP schedule hands each thread one contiguous range of weight
// rows, which keeps the hardware prefetcher on long sequential runs, while x (a few KB) stays
// in L1 and is re-read for every weight tile.

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "simd.h"

namespace tokenmill {
namespace {

// Weight rows computed together: four independent FMA chains even at M = 1, and each load of
// x serves four outputs.
constexpr int kWeightRows = 4;

// Rows of x computed together. 2 x 4 = 8 ymm accumulators cover the FMA latency (about 4
// cycles with 2 issued per cycle, so 8 in flight), and with the 4 weight vectors and one x
// vector they still fit the 16 ymm registers without spilling.
constexpr int kXRows = 2;

// One 8-wide step of every dot product in the tile. `load` is a plain or a masked load, so
// the row tail reuses this code.
template <int XRows, typename Load>
inline void fma_step(__m256 (&acc)[XRows][kWeightRows], const float* const* x,
                     const float* const* w, int64_t k, Load load) {
  __m256 wv[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) wv[j] = load(w[j] + k);
  for (int i = 0; i < XRows; ++i) {
    const __m256 xv = load(x[i] + k);
    for (int j = 0; j < kWeightRows; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
  }
}

// Dot products of XRows rows of x with kWeightRows rows of W, each of length k_len.
template <int XRows>
void dot_tile(const float* const* x, const float* const* w, int64_t k_len,
              float (&sums)[XRows][kWeightRows]) {
  __m256 acc[XRows][kWeightRows];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  const auto plain = [](const float* p) { return _mm256_loadu_ps(p); };
  int64_t k = 0;
  for (; k + 8 <= k_len; k += 8) fma_step<XRows>(acc, x, w, k, plain);
  if (k < k_len) {
    const __m256i mask = tail_mask(k_len - k);
    const auto masked = [mask](const float* p) { return _mm256_maskload_ps(p, mask); };
    fma_step<XRows>(acc, x, w, k, masked);
  }
  for (int i = 0; i < XRows; ++i)
    for (int j = 0; j < kWeightRows; ++j) sums[i][j] = horizontal_sum(acc[i][j]);
}

struct LinearArgs {
  const float* x;       // [m, k]
  const float* weight;  // [n, k]
  const float* bias;    // [n] or nullptr
  float* y;             // [m, n]
  int64_t m, n, k;
};

// y[m0 .. m0 + XRows, n0 .. n0 + valid) from one tile of dot products.
template <int XRows>
void store_tile(const LinearArgs& a, const float* const* w, int64_t m0, int64_t n0,
                int64_t valid) {
  const float* x[XRows];
  for (int i = 0; i < XRows; ++i) x[i] = a.x + (m0 + i) * a.k;
  float sums[XRows][kWeightRows];
  dot_tile<XRows>(x, w, a.k, sums);
  for (int i = 0; i < XRows; ++i) {
    float* out = a.y + (m0 + i) * a.n + n0;
    for (int64_t j = 0; j < valid; ++j) out[j] = sums[i][j] + (a.bias ? a.bias[n0 + j] : 0.0f);
  }
}

// Columns n0 .. n0 + kWeightRows of y for every row of x. Past the last weight row the tile
// re-reads row n - 1 (already in cache) and drops those sums, so an odd N needs no extra kernel.
void weight_tile(const LinearArgs& a, int64_t n0) {
  const float* w[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) w[j] = a.weight + std::min<int64_t>(n0 + j, a.n - 1) * a.k;
  const int64_t valid = std::min<int64_t>(kWeightRows, a.n - n0);
  int64_t m0 = 0;
  for (; m0 + kXRows <= a.m; m0 += kXRows) store_tile<kXRows>(a, w, m0, n0, valid);
  for (; m0 < a.m; ++m0) store_tile<1>(a, w, m0, n0, valid);
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear: x must be [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "linear: x and weight must be float32");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear: x and weight disagree on K");
  TORCH_CHECK(weight.is_contiguous(), "linear: weight must be contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "linear: bias must be a contiguous float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const LinearArgs args{xc.data_ptr<float>(), weight.data_ptr<float>(), bias_ptr,
                        y.data_ptr<float>(), m, n, k};
  const int64_t tiles = (n + kWeightRows - 1) / kWeightRows;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) weight_tile(args, t * kWeightRows);
  return y;
}

}  // namespace tokenmill
