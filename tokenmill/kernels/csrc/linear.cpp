// Skinny linear, y = x W^T + b, for decode-sized batches (a handful of rows of x), with W in
// fp32, in bfloat16 (a bfloat16 model's), or as fp8 e4m3 codes with one fp32 scale per row.
//
// With M <= 32 rows of x each weight is used at most M times, so at M = 1 the product is one
// pass over W and its speed is DRAM bandwidth, not arithmetic. The kernel streams W exactly
// once, in order: a static OpenMP schedule hands each thread one contiguous range of weight
// rows, which keeps the hardware prefetcher on long sequential runs, while x (a few KB) stays
// in L1 and is re-read for every weight tile.
//
// bfloat16 weights are widened to fp32 exactly (shifted into a float's top half) as they are
// loaded, and fp8 codes are decoded to fp32 in registers, again for every pair of rows
// of x: decoding a tile once into an L1 buffer for all pairs measured slower (4 rows of x) or
// no faster (16). The row scale multiplies the finished dot products.

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "fp8.h"
#include "quant.h"
#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

// Weight rows computed together: four independent FMA chains even at M = 1, and each load of
// x serves four outputs.
constexpr int kWeightRows = 4;

// Rows of x computed together. 2 x 4 = 8 ymm accumulators cover the FMA latency (about 4
// cycles with 2 issued per cycle, so 8 in flight), and with the 4 weight vectors and one x
// vector they still fit the 16 ymm registers without spilling.
constexpr int kXRows = 2;

// fp8 and bfloat16 tiles ahead whose bytes are requested before use. An fp8 row is only K bytes,
// and the hardware prefetcher alone left DRAM idle at tile boundaries: asking ahead nearly
// halved the time of SmolLM2's fp8 weights at batch 1. bfloat16 rows (2K bytes) gained less,
// and 4 or 8 tiles ahead did worse than 2. fp32 rows are 4x fp8's and gained nothing from it.
constexpr int64_t kPrefetchTiles = 2;

// Eight weights as fp32: loaded, bfloat16 widened, or fp8 codes decoded in registers (their
// values times 2^-8).
inline __m256 load_weights(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_weights(const uint16_t* p) { return bfloat16x8(p); }
inline __m256 load_weights(const uint8_t* p) { return fp8x8_scaled(p); }

// The last n < 8 weights of a row, zero past them, reading nothing beyond the row.
inline __m256 load_weight_tail(const float* p, __m256i mask, int64_t /*n*/) {
  return _mm256_maskload_ps(p, mask);
}
template <typename Code>
inline __m256 load_weight_tail(const Code* p, __m256i /*mask*/, int64_t n) {
  Code padded[8] = {};
  std::copy_n(p, n, padded);
  return load_weights(padded);
}

// One 8-wide step of every dot product in the tile. The loads are plain or masked ones, so the
// row tail reuses this code.
template <int XRows, typename W, typename LoadX, typename LoadW>
inline void fma_step(__m256 (&acc)[XRows][kWeightRows], const float* const* x,
                     const W* const* w, int64_t k, LoadX load_x, LoadW load_w) {
  __m256 wv[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) wv[j] = load_w(w[j] + k);
  for (int i = 0; i < XRows; ++i) {
    const __m256 xv = load_x(x[i] + k);
    for (int j = 0; j < kWeightRows; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
  }
}

// Dot products of XRows rows of x with kWeightRows rows of W, each of length k_len.
template <int XRows, typename W>
void dot_tile(const float* const* x, const W* const* w, int64_t k_len,
              float (&sums)[XRows][kWeightRows]) {
  __m256 acc[XRows][kWeightRows];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  const auto plain_x = [](const float* p) { return _mm256_loadu_ps(p); };
  const auto plain_w = [](const W* p) { return load_weights(p); };
  int64_t k = 0;
  for (; k + 8 <= k_len; k += 8) fma_step<XRows>(acc, x, w, k, plain_x, plain_w);
  if (k < k_len) {
    const int64_t n = k_len - k;
    const __m256i mask = tail_mask(n);
    const auto masked_x = [mask](const float* p) { return _mm256_maskload_ps(p, mask); };
    const auto masked_w = [mask, n](const W* p) { return load_weight_tail(p, mask, n); };
    fma_step<XRows>(acc, x, w, k, masked_x, masked_w);
  }
  for (int i = 0; i < XRows; ++i)
    for (int j = 0; j < kWeightRows; ++j) sums[i][j] = horizontal_sum(acc[i][j]);
}

// A weight of float32 or bfloat16 (uint16_t) elements, or e4m3 codes with a scale per row,
// which multiplies the row's finished dot products (`output_scale`).
template <typename T>
struct PlainRows {
  using Element = T;
  const T* weight;  // [n, k]
  int64_t k;
  const T* row(int64_t r) const { return weight + r * k; }
  float output_scale(int64_t /*r*/) const { return 1.0f; }
};
using Float32Rows = PlainRows<float>;
using Bfloat16Rows = PlainRows<uint16_t>;

struct Fp8Rows {
  using Element = uint8_t;
  const uint8_t* codes;  // [n, k] e4m3
  const float* scales;   // [n]
  int64_t k;
  const uint8_t* row(int64_t r) const { return codes + r * k; }
  float output_scale(int64_t r) const { return scales[r] * kFp8DecodeScale; }
};

template <typename Rows>
struct LinearArgs {
  const float* x;  // [m, k]
  Rows weight;
  const float* bias;  // [n] or nullptr
  float* y;           // [m, n]
  int64_t m, n, k;
};

// y[m0 .. m0 + XRows, n0 .. n0 + valid) from one tile of dot products.
template <int XRows, typename Rows, typename W>
void store_tile(const LinearArgs<Rows>& a, const W* const* w, int64_t m0, int64_t n0,
                int64_t valid) {
  const float* x[XRows];
  for (int i = 0; i < XRows; ++i) x[i] = a.x + (m0 + i) * a.k;
  float sums[XRows][kWeightRows];
  dot_tile<XRows>(x, w, a.k, sums);
  for (int i = 0; i < XRows; ++i) {
    float* out = a.y + (m0 + i) * a.n + n0;
    for (int64_t j = 0; j < valid; ++j)
      out[j] = sums[i][j] * a.weight.output_scale(n0 + j) + (a.bias ? a.bias[n0 + j] : 0.0f);
  }
}

// Columns n0 .. n0 + kWeightRows of y for every row of x. Past the last weight row the tile
// re-reads row n - 1 (already in cache) and drops those sums, so an odd N needs no extra kernel.
template <typename Rows>
void weight_tile(const LinearArgs<Rows>& a, int64_t n0) {
  const int64_t ahead = n0 + kPrefetchTiles * kWeightRows;
  if (!std::is_same_v<Rows, Float32Rows> && ahead < a.n) {
    const char* next = reinterpret_cast<const char*>(a.weight.row(ahead));
    const int64_t bytes =
        std::min<int64_t>(kWeightRows, a.n - ahead) * a.k * sizeof(typename Rows::Element);
    for (int64_t offset = 0; offset < bytes; offset += 64)
      _mm_prefetch(next + offset, _MM_HINT_T0);
  }
  const typename Rows::Element* w[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) w[j] = a.weight.row(std::min<int64_t>(n0 + j, a.n - 1));
  const int64_t valid = std::min<int64_t>(kWeightRows, a.n - n0);
  int64_t m0 = 0;
  for (; m0 + kXRows <= a.m; m0 += kXRows) store_tile<kXRows>(a, w, m0, n0, valid);
  for (; m0 < a.m; ++m0) store_tile<1>(a, w, m0, n0, valid);
}

// Checks x [M, K] and the bias against a weight of n rows of k inputs; returns contiguous x.
at::Tensor check_linear(const char* op, const at::Tensor& x, int64_t n, int64_t k,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be float32 [M, K]");
  TORCH_CHECK(x.size(1) == k, op, ": x and weight disagree on K");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                op, ": bias must be a contiguous float32 [N]");
  return x.contiguous();
}

template <typename Rows>
void run(const at::Tensor& x, Rows weight, const float* bias, const at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  const LinearArgs<Rows> args{x.data_ptr<float>(), weight, bias, y.data_ptr<float>(), m, n, k};
  const int64_t tiles = (n + kWeightRows - 1) / kWeightRows;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) weight_tile(args, t * kWeightRows);
}

}  // namespace

void skinny_linear_team(const at::Tensor& x, const at::Tensor& weight, const float* bias,
                        const at::Tensor& y) {
  if (weight.scalar_type() == at::kBFloat16) {
    run(x, Bfloat16Rows{static_cast<const uint16_t*>(weight.data_ptr()), weight.size(1)}, bias, y);
    return;
  }
  run(x, Float32Rows{weight.data_ptr<float>(), weight.size(1)}, bias, y);
}

void fp8_linear_team(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const float* bias, const at::Tensor& y) {
  const Fp8Rows rows{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                     qweight.size(1)};
  run(x, rows, bias, y);
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "linear: weight must be a contiguous float32 or bfloat16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor xc = check_linear("linear", x, n, k, bias);
  at::Tensor y = at::empty({xc.size(0), n}, xc.options());
#pragma omp parallel
  skinny_linear_team(xc, weight, bias ? bias->data_ptr<float>() : nullptr, y);
  return y;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& bias) {
  check_fp8_weight("fp8_linear", qweight, scales);
  const int64_t n = qweight.size(0), k = qweight.size(1);
  const at::Tensor xc = check_linear("fp8_linear", x, n, k, bias);
  at::Tensor y = at::empty({xc.size(0), n}, xc.options());
#pragma omp parallel
  fp8_linear_team(xc, qweight, scales, bias ? bias->data_ptr<float>() : nullptr, y);
  return y;
}

}  // namespace tokenmill
