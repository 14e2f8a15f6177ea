// y = x W^T + b for fp32 x and a GGUF Q6_K weight kept in its super-block form: int8 codes
// q in -32..31, an int8 scale s per 16 inputs and an fp16 scale d per 256 (w = d * s * q).
// The int8 kernel's groups are whole blocks of 32, so Q6_K's halves of a block, each with its
// own s, get this kernel.
//
// Layout (ops.pack_q6_k_panels): panels of 8 output rows, each 32-bit lane of a vector one row.
// Per panel and block of 32 inputs, 256 bytes of codes in the int8 panels' layout (sixteen
// 16-byte units, unit u holding for row r the codes of inputs 2u and 2u + 1 in bytes 2r and
// 2r + 1: units 0-7 are the block's first 16 inputs, 8-15 its last 16); sub_scales
// [panels, K / 16, 8] and super_scales [panels, K / 256, 8].
//
// x is rounded to int16 per block of 32 (QuantizedRows, as for int8 weights). The codes widen to
// int16 and _mm256_madd_epi16 multiplies them by pairs of activations into each row's lane:
// every half block's sum is exact in int32 (16 * 32 * 32767 < 2^24), then one FMA per half adds
// it scaled by d * s (one fp32 rounding, the dequantization's) times the block's x scale.
//
// The same layout with a min per 32 inputs (w = d * s * q + min) holds Q5_K's 5-bit codes and
// Q4_K's 4-bit ones exactly as well (their 6-bit scales fit s, which then repeats over a block's
// halves): the form of a linear merged from parts of several k-quant types. A block's min adds
// min * d_x * sum(q_x), the block sum the activation rounding keeps (QuantizedRows).

#include "kquant.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "quant.h"
#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

constexpr int64_t kPanelRows = 8;
constexpr int64_t kBlockBytes = kPanelRows * kQuantBlock;
constexpr int64_t kSubBlock = 16;
constexpr int64_t kSuperBlock = 256;
constexpr int64_t kBlocksPerSuper = kSuperBlock / kQuantBlock;
// Rows of x per pass over a panel, each code vector widened once for all of them.
constexpr int kXRows = 4;
// Bytes ahead of the block being read that are prefetched (as the int8 / int4 kernels do: the
// hardware prefetcher stops at every 4 KB page).
constexpr int64_t kPrefetchBytes = 2048;

struct Problem {
  const QuantizedRows<int16_t>* x;
  const uint8_t* values;         // [panels, blocks * kBlockBytes]
  const int8_t* sub_scales;      // [panels, blocks * 2, 8]
  const at::Half* super_scales;  // [panels, blocks / 8, 8]
  const float* mins;             // [panels, blocks, 8] or nullptr
  const float* bias;             // [n] or nullptr
  float* y;                      // [m, n]
  int64_t m, n, blocks;
};

// Two int16 activations in every 32-bit lane.
inline __m256i broadcast_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// The 8 rows' int8 scales of one sub-block, as fp32.
inline __m256 sub_scales8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// y[m0 .. m0 + XRows, the panel's outputs].
template <int XRows>
void panel_rows(const Problem& p, int64_t panel, int64_t m0) {
  const int16_t* xq[XRows];
  const float* xd[XRows];
  for (int i = 0; i < XRows; ++i) {
    xq[i] = p.x->values(m0 + i);
    xd[i] = p.x->scales(m0 + i);
  }
  const uint8_t* w = p.values + panel * p.blocks * kBlockBytes;
  const int8_t* sub = p.sub_scales + panel * p.blocks * 2 * kPanelRows;
  const at::Half* super = p.super_scales + panel * (p.blocks / kBlocksPerSuper) * kPanelRows;
  const float* mins = p.mins ? p.mins + panel * p.blocks * kPanelRows : nullptr;
  __m256 acc[XRows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  __m256 d = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    if (b % kBlocksPerSuper == 0) d = load8(super + b / kBlocksPerSuper * kPanelRows);
    const uint8_t* block = w + b * kBlockBytes;
    for (int64_t line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + line), _MM_HINT_T0);
    __m256i low[XRows], high[XRows];
    for (int i = 0; i < XRows; ++i) low[i] = high[i] = _mm256_setzero_si256();
    for (int u = 0; u < 8; ++u) {
      const __m256i first = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * u)));
      const __m256i second = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * (u + 8))));
      for (int i = 0; i < XRows; ++i) {
        const int16_t* x = xq[i] + b * kQuantBlock + 2 * u;
        low[i] = _mm256_add_epi32(low[i], _mm256_madd_epi16(first, broadcast_pair(x)));
        high[i] = _mm256_add_epi32(high[i], _mm256_madd_epi16(second, broadcast_pair(x + 16)));
      }
    }
    const __m256 scale_low = _mm256_mul_ps(d, sub_scales8(sub + 2 * b * kPanelRows));
    const __m256 scale_high = _mm256_mul_ps(d, sub_scales8(sub + (2 * b + 1) * kPanelRows));
    for (int i = 0; i < XRows; ++i) {
      const __m256 xs = _mm256_set1_ps(xd[i][b]);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low[i]), _mm256_mul_ps(scale_low, xs), acc[i]);
      acc[i] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(high[i]), _mm256_mul_ps(scale_high, xs), acc[i]);
    }
    if (mins != nullptr) {
      const __m256 min = _mm256_loadu_ps(mins + b * kPanelRows);
      for (int i = 0; i < XRows; ++i)
        acc[i] = _mm256_fmadd_ps(min, _mm256_set1_ps(p.x->sums(m0 + i)[b]), acc[i]);
    }
  }
  const int64_t n0 = panel * kPanelRows;
  const __m256i lanes = tail_mask(std::min(kPanelRows, p.n - n0));
  const __m256 bias = p.bias ? _mm256_maskload_ps(p.bias + n0, lanes) : _mm256_setzero_ps();
  for (int i = 0; i < XRows; ++i)
    _mm256_maskstore_ps(p.y + (m0 + i) * p.n + n0, lanes, _mm256_add_ps(acc[i], bias));
}

// Every row of x against one panel, kXRows rows a pass.
void panel(const Problem& p, int64_t panel) {
  int64_t m0 = 0;
  for (; m0 + kXRows <= p.m; m0 += kXRows) panel_rows<kXRows>(p, panel, m0);
  switch (p.m - m0) {
    case 3:
      panel_rows<3>(p, panel, m0);
      break;
    case 2:
      panel_rows<2>(p, panel, m0);
      break;
    case 1:
      panel_rows<1>(p, panel, m0);
      break;
    default:
      break;
  }
}

}  // namespace

void check_q6_k_panels(const char* op, const at::Tensor& values, const at::Tensor& sub_scales,
                       const at::Tensor& super_scales, const at::Tensor& mins, int64_t n,
                       int64_t k) {
  TORCH_CHECK(k > 0 && k % kSuperBlock == 0, op,
              ": Q6_K weights have a multiple of 256 inputs, got ", k);
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  const int64_t blocks = k / kQuantBlock;
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kByte && values.is_contiguous() &&
                  values.size(0) == panels && values.size(1) == blocks * kBlockBytes,
              op, ": values must be contiguous uint8 [", panels, ", ", blocks * kBlockBytes,
              "] for ", n, " outputs of ", k, " inputs");
  TORCH_CHECK(sub_scales.scalar_type() == at::kChar && sub_scales.is_contiguous() &&
                  sub_scales.dim() == 3 && sub_scales.size(0) == panels &&
                  sub_scales.size(1) == k / kSubBlock && sub_scales.size(2) == kPanelRows,
              op, ": sub_scales must be contiguous int8 [", panels, ", ", k / kSubBlock, ", 8]");
  TORCH_CHECK(super_scales.scalar_type() == at::kHalf && super_scales.is_contiguous() &&
                  super_scales.dim() == 3 && super_scales.size(0) == panels &&
                  super_scales.size(1) == k / kSuperBlock && super_scales.size(2) == kPanelRows,
              op, ": super_scales must be contiguous float16 [", panels, ", ", k / kSuperBlock,
              ", 8]");
  if (mins.defined())
    TORCH_CHECK(mins.scalar_type() == at::kFloat && mins.is_contiguous() && mins.dim() == 3 &&
                    mins.size(0) == panels && mins.size(1) == blocks &&
                    mins.size(2) == kPanelRows,
                op, ": mins must be contiguous float32 [", panels, ", ", blocks, ", 8]");
}

int64_t q6_k_linear_scratch_bytes(int64_t m, int64_t k) {
  return QuantizedRows<int16_t>::storage_bytes(m, (k + kQuantBlock - 1) / kQuantBlock);
}

void q6_k_linear_team(const at::Tensor& x, const at::Tensor& values,
                      const at::Tensor& sub_scales, const at::Tensor& super_scales,
                      const at::Tensor& mins, const float* bias, const at::Tensor& y,
                      void* scratch) {
  Problem p{};
  p.values = values.data_ptr<uint8_t>();
  p.sub_scales = sub_scales.data_ptr<int8_t>();
  p.super_scales = super_scales.data_ptr<at::Half>();
  p.mins = mins.defined() ? mins.data_ptr<float>() : nullptr;
  p.bias = bias;
  p.y = y.data_ptr<float>();
  p.m = x.size(0);
  p.n = y.size(1);
  p.blocks = x.size(1) / kQuantBlock;
  QuantizedRows<int16_t> quantized(scratch, p.m, p.blocks);
  quantized.quantize(x.data_ptr<float>(), p.m, x.size(1));
  p.x = &quantized;
  const int64_t panels = (p.n + kPanelRows - 1) / kPanelRows;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < panels; ++t) panel(p, t);
}

at::Tensor q6_k_linear(const at::Tensor& x, const at::Tensor& values,
                       const at::Tensor& sub_scales, const at::Tensor& super_scales,
                       const std::optional<at::Tensor>& mins, int64_t n,
                       const std::optional<at::Tensor>& bias) {
  const char* op = "q6_k_linear";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, op,
              ": x must be float32 [M, K] with K > 0");
  const at::Tensor block_mins = mins.value_or(at::Tensor());
  check_q6_k_panels(op, values, sub_scales, super_scales, block_mins, n, x.size(1));
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                op, ": bias must be a contiguous float32 [N]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  at::Tensor scratch =
      at::empty({q6_k_linear_scratch_bytes(x.size(0), x.size(1))}, x.options().dtype(at::kByte));
#pragma omp parallel
  q6_k_linear_team(xc, values, sub_scales, super_scales, block_mins,
                   bias.has_value() ? bias->data_ptr<float>() : nullptr, y, scratch.data_ptr());
  return y;
}

}  // namespace tokenmill
