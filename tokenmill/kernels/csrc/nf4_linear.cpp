// NF4 weights (QLoRA's 4-bit NormalFloat): y = x W^T + b for skinny x, and W dequantized to fp32
// (given its absmax in fp32) a tile of rows at a time for the wide products.
//
// Layout (tokenmill/kernels/nf4_linear.py): codes uint8 [N, K' / 2] with K' = K padded to whole
// groups, each 64 inputs in 32 bytes, input i in the low nibble of byte i and 32 + i in its high
// one (the int4 layout); w = NF4[code] * absmax, one absmax per row and group of `group_size`
// inputs. The absmax are double-quantized as bitsandbytes stores them: absmax = map[q] * a2 + c,
// q one uint8 per group, `map` bitsandbytes' signed dynamic 8-bit map, a2 one fp32 per 256
// consecutive groups (row-major over [N, groups]) and c one fp32 offset. The kernels read those
// three as one fp32 tensor, `second` = [c, map[0..255], a2...].
//
// The 16 NF4 values live in registers: two ymm halves picked between by the code's top bit
// (vpermps on each, then a blend) on AVX2, one zmm (a single vpermps) on AVX-512. A group's
// absmax is dequantized once per row and 64 inputs and multiplies the decoded codes, which then
// serve every row of x. Like the fp8 kernel (linear.cpp), a static schedule hands each thread a
// contiguous range of weight rows, read once and in order.

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "kernels.h"
#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

constexpr int64_t kUnit = 64;        // inputs per 32 bytes of codes
constexpr int64_t kUnitBytes = 32;
constexpr int64_t kMapEntries = 256;  // the dynamic map's entries
constexpr int64_t kSecondBlock = 256;  // absmax per second-level scale
constexpr int kWeightRows = 4;  // rows of W per tile: four independent FMA chains at M = 1
constexpr int kXRows = 2;       // rows of x per tile
constexpr int64_t kPrefetchTiles = 2;

// QLoRA's NF4 code values (bitsandbytes' table), in code order.
alignas(64) constexpr float kNf4[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f};

struct Nf4Weight {
  const uint8_t* codes;    // [n, row_bytes]
  const uint8_t* qabsmax;  // [n, groups]
  const float* second;     // [1 + 256 + ceil(n * groups / 256)]
  int64_t n, k, row_bytes, groups, group_size;

  const uint8_t* row(int64_t r) const { return codes + r * row_bytes; }
  // Row r's absmax of group g.
  float absmax(int64_t r, int64_t g) const {
    const int64_t i = r * groups + g;
    const float scaled = second[1 + qabsmax[i]] * second[1 + kMapEntries + i / kSecondBlock];
    return scaled + second[0];
  }
};

Nf4Weight nf4_weight(const at::Tensor& codes, const at::Tensor& qabsmax, const at::Tensor& second,
                     int64_t group_size, int64_t k) {
  return {codes.data_ptr<uint8_t>(), qabsmax.data_ptr<uint8_t>(), second.data_ptr<float>(),
          codes.size(0), k, codes.size(1), qabsmax.size(1), group_size};
}

// x's 8 values from p, zero past `left` of them (nothing past them is read).
inline __m256 load_x8(const float* p, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(p);
  return _mm256_maskload_ps(p, tail_mask(std::max<int64_t>(left, 0)));
}

// The 16 codes of 8 bytes as fp32: `low` from their low nibbles, `high` from their high ones.
inline void decode16(const uint8_t* p, __m256 lut_lo, __m256 lut_hi, __m256& low, __m256& high) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  // vpermps reads an index's low 3 bits; the blend takes the upper table where bit 3 is set.
  low = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, b), _mm256_permutevar8x32_ps(lut_hi, b),
                         _mm256_castsi256_ps(_mm256_slli_epi32(b, 28)));
  const __m256i h = _mm256_srli_epi32(b, 4);
  high = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, h),
                          _mm256_permutevar8x32_ps(lut_hi, h),
                          _mm256_castsi256_ps(_mm256_slli_epi32(b, 24)));
}

// sums[i][j] = row m0 + i of x . row n0 + j of W (AVX2), rows past n reading row n - 1.
template <int XRows>
void dot_tile(const Nf4Weight& w, const float* x, int64_t m0, int64_t n0,
              float (&sums)[XRows][kWeightRows]) {
  const __m256 lut_lo = _mm256_load_ps(kNf4), lut_hi = _mm256_load_ps(kNf4 + 8);
  __m256 acc[XRows][kWeightRows];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  int64_t rows[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) rows[j] = std::min<int64_t>(n0 + j, w.n - 1);
  const float* xs = x + m0 * w.k;
  // The group index advances without a division: a unit of 64 never spans two groups.
  for (int64_t k0 = 0, g = 0, group_end = w.group_size; k0 < w.k; k0 += kUnit) {
    if (k0 == group_end) ++g, group_end += w.group_size;
    const int64_t left = w.k - k0;
    for (int j = 0; j < kWeightRows; ++j) {
      const __m256 scale = _mm256_set1_ps(w.absmax(rows[j], g));
      const uint8_t* p = w.row(rows[j]) + k0 / 2;
      for (int q = 0; q < 4; ++q) {
        __m256 low, high;
        decode16(p + 8 * q, lut_lo, lut_hi, low, high);
        low = _mm256_mul_ps(low, scale);
        high = _mm256_mul_ps(high, scale);
        for (int i = 0; i < XRows; ++i) {
          const float* xi = xs + i * w.k + k0;
          acc[i][j] = _mm256_fmadd_ps(low, load_x8(xi + 8 * q, left - 8 * q), acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(high, load_x8(xi + 32 + 8 * q, left - 32 - 8 * q),
                                      acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < XRows; ++i)
    for (int j = 0; j < kWeightRows; ++j) sums[i][j] = horizontal_sum(acc[i][j]);
}

// x's 16 values from p, zero past `left` of them (nothing past them is read).
[[gnu::target("avx512f")]] inline __m512 load_x16(const float* p, int64_t left) {
  if (left >= 16) return _mm512_loadu_ps(p);
  const auto mask = static_cast<__mmask16>(left <= 0 ? 0 : (1u << left) - 1);
  return _mm512_maskz_loadu_ps(mask, p);
}

// dot_tile on AVX-512: the 16 values in one zmm, 16 bytes of codes decoded at a time.
template <int XRows>
[[gnu::target("avx512f,avx512dq,avx512bw,avx512vl")]] void dot_tile_avx512(
    const Nf4Weight& w, const float* x, int64_t m0, int64_t n0,
    float (&sums)[XRows][kWeightRows]) {
  const __m512 lut = _mm512_load_ps(kNf4);
  __m512 acc[XRows][kWeightRows];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  int64_t rows[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) rows[j] = std::min<int64_t>(n0 + j, w.n - 1);
  const float* xs = x + m0 * w.k;
  for (int64_t k0 = 0, g = 0, group_end = w.group_size; k0 < w.k; k0 += kUnit) {
    if (k0 == group_end) ++g, group_end += w.group_size;
    const int64_t left = w.k - k0;
    for (int j = 0; j < kWeightRows; ++j) {
      const __m512 scale = _mm512_set1_ps(w.absmax(rows[j], g));
      const uint8_t* p = w.row(rows[j]) + k0 / 2;
      for (int q = 0; q < 2; ++q) {
        const __m512i b =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q)));
        // vpermps on zmm reads an index's low 4 bits: the low nibble as it is.
        const __m512 low = _mm512_mul_ps(_mm512_permutexvar_ps(b, lut), scale);
        const __m512 high =
            _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), scale);
        for (int i = 0; i < XRows; ++i) {
          const float* xi = xs + i * w.k + k0;
          acc[i][j] = _mm512_fmadd_ps(low, load_x16(xi + 16 * q, left - 16 * q), acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(high, load_x16(xi + 32 + 16 * q, left - 32 - 16 * q),
                                      acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < XRows; ++i)
    for (int j = 0; j < kWeightRows; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

const bool kAvx512 = avx512_usable();

template <int XRows>
void store_tile(const Nf4Weight& w, const float* x, const float* bias, float* y, int64_t m0,
                int64_t n0) {
  float sums[XRows][kWeightRows];
  if (kAvx512)
    dot_tile_avx512<XRows>(w, x, m0, n0, sums);
  else
    dot_tile<XRows>(w, x, m0, n0, sums);
  const int64_t valid = std::min<int64_t>(kWeightRows, w.n - n0);
  for (int i = 0; i < XRows; ++i) {
    float* out = y + (m0 + i) * w.n + n0;
    for (int64_t j = 0; j < valid; ++j) out[j] = sums[i][j] + (bias ? bias[n0 + j] : 0.0f);
  }
}

// Columns n0 .. n0 + 4 of y for every row of x, asking for the codes two tiles ahead first.
void weight_tile(const Nf4Weight& w, const float* x, int64_t m, const float* bias, float* y,
                 int64_t n0) {
  const int64_t ahead = n0 + kPrefetchTiles * kWeightRows;
  if (ahead < w.n) {
    const auto* next = reinterpret_cast<const char*>(w.row(ahead));
    const int64_t bytes = std::min<int64_t>(kWeightRows, w.n - ahead) * w.row_bytes;
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(next + offset, _MM_HINT_T0);
  }
  int64_t m0 = 0;
  for (; m0 + kXRows <= m; m0 += kXRows) store_tile<kXRows>(w, x, bias, y, m0, n0);
  for (; m0 < m; ++m0) store_tile<1>(w, x, bias, y, m0, n0);
}

}  // namespace

void check_nf4_weight(const char* op, const at::Tensor& codes, const at::Tensor& qabsmax,
                      const at::Tensor& second, int64_t n, int64_t k, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size % kUnit == 0, op,
              ": group_size must be a positive multiple of 64, got ", group_size);
  const int64_t groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(0) == n && codes.size(1) == groups * group_size / 2,
              op, ": codes must be a contiguous uint8 [", n, ", ", groups * group_size / 2, "]");
  TORCH_CHECK(qabsmax.dim() == 2 && qabsmax.scalar_type() == at::kByte &&
                  qabsmax.is_contiguous() && qabsmax.size(0) == n && qabsmax.size(1) == groups,
              op, ": qabsmax must be a contiguous uint8 [", n, ", ", groups, "]");
  const int64_t seconds = (n * groups + kSecondBlock - 1) / kSecondBlock;
  TORCH_CHECK(second.dim() == 1 && second.scalar_type() == at::kFloat && second.is_contiguous() &&
                  second.numel() == 1 + kMapEntries + seconds,
              op, ": second must be a contiguous float32 [", 1 + kMapEntries + seconds, "]");
}

void nf4_linear_team(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& qabsmax,
                     const at::Tensor& second, int64_t group_size, const float* bias,
                     const at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1);
  const Nf4Weight w = nf4_weight(codes, qabsmax, second, group_size, k);
  const float* xs = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t tiles = (w.n + kWeightRows - 1) / kWeightRows;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) weight_tile(w, xs, m, bias, out, t * kWeightRows);
}

at::Tensor nf4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& qabsmax,
                      const at::Tensor& second, int64_t group_size,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "nf4_linear: x must be float32 [M, K]");
  const int64_t n = codes.size(0), k = x.size(1);
  check_nf4_weight("nf4_linear", codes, qabsmax, second, n, k, group_size);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "nf4_linear: bias must be a contiguous float32 [N]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({xc.size(0), n}, xc.options());
#pragma omp parallel
  nf4_linear_team(xc, codes, qabsmax, second, group_size,
                  bias.has_value() ? bias->data_ptr<float>() : nullptr, y);
  return y;
}

at::Tensor dequantize_nf4(const at::Tensor& codes, const at::Tensor& absmax, int64_t group_size,
                          int64_t in_features) {
  const int64_t n = codes.size(0), k = in_features;
  TORCH_CHECK(group_size > 0 && group_size % kUnit == 0,
              "dequantize_nf4: group_size must be a positive multiple of 64, got ", group_size);
  const int64_t groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == groups * group_size / 2,
              "dequantize_nf4: codes must be a contiguous uint8 [N, ", groups * group_size / 2,
              "]");
  TORCH_CHECK(absmax.dim() == 2 && absmax.scalar_type() == at::kFloat && absmax.is_contiguous() &&
                  absmax.size(0) == n && absmax.size(1) == groups,
              "dequantize_nf4: absmax must be a contiguous float32 [", n, ", ", groups, "]");
  const uint8_t* src = codes.data_ptr<uint8_t>();
  const float* scales = absmax.data_ptr<float>();
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const int64_t row_bytes = codes.size(1);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const __m256 lut_lo = _mm256_load_ps(kNf4), lut_hi = _mm256_load_ps(kNf4 + 8);
    for (int64_t k0 = 0; k0 < k; k0 += kUnit) {
      const __m256 scale = _mm256_set1_ps(scales[r * groups + k0 / group_size]);
      const uint8_t* p = src + r * row_bytes + k0 / 2;
      float* row = dst + r * k + k0;
      for (int q = 0; q < 4; ++q) {
        __m256 low, high;
        decode16(p + 8 * q, lut_lo, lut_hi, low, high);
        const int64_t left_low = k - k0 - 8 * q, left_high = left_low - 32;
        if (left_low > 0)
          _mm256_maskstore_ps(row + 8 * q, tail_mask(std::min<int64_t>(left_low, 8)),
                              _mm256_mul_ps(low, scale));
        if (left_high > 0)
          _mm256_maskstore_ps(row + 32 + 8 * q, tail_mask(std::min<int64_t>(left_high, 8)),
                              _mm256_mul_ps(high, scale));
      }
    }
  }
  return out;
}

}  // namespace tokenmill
