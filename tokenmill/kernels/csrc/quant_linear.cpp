// y = x W^T + b for fp32 x and W stored as int8 or int4 along K, with one fp16 or fp32 scale
// per row and group of `group_size` inputs (int4 also an offset, "min", per group):
//   int8: w = scale * q,        q in [-128, 127]; a row is ceil(K / 32) * 32 bytes.
//   int4: w = scale * q + min,  q in [0, 15]; each 64 inputs take 32 bytes, input i in the low
//         nibble of byte i and input 32 + i in its high nibble; a row is ceil(K / 64) * 32 bytes.
// int8 with groups of 32 and fp16 scales is GGUF's Q8_0 block for block; int4 with groups of 32
// holds GGUF's Q4_1 (and Q4_0, min = -8 * scale) once their nibbles are regrouped.
//
// x is quantized per block of 32 (QuantizedRows), so each block's dot product is integer, and
// one FMA per block scales it by (weight scale * x scale) into fp32 accumulators.
//   int4 x int8 (llama.cpp's way): _mm256_maddubs_epi16 multiplies 32 unsigned nibbles by 32
//     signed bytes into 16 pair sums, _mm256_madd_epi16 widens them to 8 int32: 32 products in
//     two instructions, which keeps this compute-bound kernel near DRAM speed. The 64-input
//     layout unpacks 32 loaded bytes with two ANDs and a shift, half the work of GGUF's blocks.
//   int8 x int16: the weights widen to int16 and _mm256_madd_epi16 multiplies; twice the work
//     per product, but int8 weights are memory-bound anyway, and int16 activations make their
//     rounding negligible (int8 activations would double int8's KL divergence on SmolLM2).
// Weights stream once per chunk of x rows; OpenMP splits the weight rows statically, so each
// thread reads one contiguous range and, over the chunks of a wide x, finds it still in its L2.

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "quant.h"
#include "simd.h"

namespace tokenmill {
namespace {

constexpr int kWeightRows = 4;  // four independent accumulator chains per row of x
constexpr int kXRows = 2;       // each unpacked weight unit serves two rows of x
// Rows of x per pass over the weights: their integer form (64 x K or 64 x 2K bytes) stays in L2.
constexpr int64_t kXChunk = 64;
// Blocks per pass of a tile: their combined scales take a few KB of stack.
constexpr int64_t kScaleBlocks = 64;
constexpr int64_t kUnitBytes = 32;  // weight bytes loaded at once, in both formats

inline __m256i load_unit(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i pair_sums_to_i32(__m256i pairs) {
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

template <typename ScaleT>
struct Int8Weights {
  using Scale = ScaleT;
  using Activation = int16_t;  // int8 x int16 products, exact in int32 lanes
  static constexpr bool kHasMins = false;
  static constexpr int kBlocksPerUnit = 1;
  struct Unit {
    __m256i low, high;  // the block's values 0..15 and 16..31, widened to int16
  };
  static Unit unpack(const uint8_t* p) {
    const __m256i w = load_unit(p);
    return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)),
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1))};
  }
  // Lane l sums 4 products of at most 128 * 32767: |sum| < 2^24, so the fp32 convert is exact.
  static __m256i dot(const Unit& w, int /*half*/, const Activation* x) {
    const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    return _mm256_add_epi32(_mm256_madd_epi16(w.low, x_low), _mm256_madd_epi16(w.high, x_high));
  }
};

template <typename ScaleT>
struct Int4Weights {
  using Scale = ScaleT;
  using Activation = int8_t;  // unsigned nibbles x int8 in maddubs
  static constexpr bool kHasMins = true;
  static constexpr int kBlocksPerUnit = 2;
  struct Unit {
    __m256i low, high;  // inputs 0..31 and 32..63 of the unit, one per byte
  };
  static Unit unpack(const uint8_t* p) {
    const __m256i packed = load_unit(p), mask = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(packed, mask),
            _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask)};
  }
  static __m256i dot(const Unit& w, int half, const Activation* x) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return pair_sums_to_i32(_mm256_maddubs_epi16(half ? w.high : w.low, xv));
  }
};

template <typename Weights>
struct Problem {
  using Scale = typename Weights::Scale;
  const QuantizedRows<typename Weights::Activation>* x;
  const uint8_t* values;    // [n, units * 32]
  const Scale* scales;      // [n, groups]
  const Scale* mins;        // [n, groups] for int4, else nullptr
  const float* group_sums;  // [m, groups]: Σ over a group's blocks of x's d * sum(q) (int4)
  const float* bias;        // [n] or nullptr
  float* y;                 // [m, n]
  int64_t m, n, blocks, units, groups, blocks_per_group;
};

// Σ_g a[g] * b[g] over n groups: the int4 offset term of one output.
template <typename Scale>
float dot_groups(const Scale* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= n; g += 8) acc = _mm256_fmadd_ps(load8(a + g), _mm256_loadu_ps(b + g), acc);
  float sum = horizontal_sum(acc);
  for (; g < n; ++g) sum += to_float(a[g]) * b[g];
  return sum;
}

// values[0, count) as fp32, 8 at a time while 8 remain (never reading past the last).
template <typename Scale>
inline void to_floats(const Scale* values, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, load8(values + i));
  for (; i < count; ++i) out[i] = to_float(values[i]);
}

// The weight scale of each of the first `real` blocks from block b0 of one row: its group's
// (values past `real`, up to the next multiple of 8, are left unspecified).
template <typename Scale>
inline void block_scales(const Scale* row_scales, int64_t blocks_per_group, int64_t b0,
                         int64_t real, float* out) {
  if (blocks_per_group == 1) {
    to_floats(row_scales + b0, real, out);
    return;
  }
  if (blocks_per_group == 2 || blocks_per_group == 4) {  // groups of 64 or 128 inputs
    // b0 is a multiple of kScaleBlocks and so of the group. Eight groups convert at once and
    // stay in a register; each permute of them repeats 8 / blocks_per_group over 8 blocks.
    const int64_t first = b0 / blocks_per_group;
    const int64_t groups = (real + blocks_per_group - 1) / blocks_per_group;
    const __m256i repeat = blocks_per_group == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                                 : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int64_t g = 0; g < groups; g += 8) {
      __m256 eight;
      if (g + 8 <= groups) {
        eight = load8(row_scales + first + g);
      } else {
        alignas(32) float tail[8] = {};
        to_floats(row_scales + first + g, groups - g, tail);
        eight = _mm256_load_ps(tail);
      }
      for (int64_t k = 0; k < blocks_per_group && (g + k * 8 / blocks_per_group) < groups; ++k) {
        const __m256i index = _mm256_add_epi32(repeat, _mm256_set1_epi32(k * 8 / blocks_per_group));
        _mm256_store_ps(out + g * blocks_per_group + 8 * k, _mm256_permutevar8x32_ps(eight, index));
      }
    }
    return;
  }
  // Any other size, per-channel scales (one group per row) included: one conversion a group.
  int64_t g = b0 / blocks_per_group, left = (g + 1) * blocks_per_group - b0;
  float scale = to_float(row_scales[g]);
  for (int64_t b = 0; b < real; ++b, --left) {
    if (left == 0) {
      scale = to_float(row_scales[++g]);
      left = blocks_per_group;
    }
    out[b] = scale;
  }
}

// out[i][b] = (weight scale of block b0 + b of one row) * (scale of that block of x row i), for
// the `count` blocks of a pass; 0 past the row's last real block, whose nibbles are padding.
template <int XRows, typename Scale>
inline void combine_scales(const Scale* row_scales, int64_t blocks, int64_t blocks_per_group,
                           const float* const (&xd)[XRows], int64_t b0, int64_t count,
                           float (&out)[XRows][kScaleBlocks]) {
  const int64_t real = std::clamp<int64_t>(blocks - b0, 0, count);
  alignas(32) float weight[kScaleBlocks + 8];
  block_scales(row_scales, blocks_per_group, b0, real, weight);
  for (int i = 0; i < XRows; ++i) {
    for (int64_t b = 0; b < real; ++b) out[i][b] = weight[b] * xd[i][b0 + b];
    for (int64_t b = real; b < count; ++b) out[i][b] = 0.0f;
  }
}

// Tiles ahead whose bytes are prefetched: rows are short (a few hundred bytes), so the hardware
// prefetcher alone leaves DRAM idle at every tile boundary.
constexpr int64_t kPrefetchTiles = 2;

// A tile's scales (or mins): `groups` values for each of its rows, contiguous.
template <typename Scale>
inline void prefetch_group_values(const Scale* first, int64_t groups) {
  const char* begin = reinterpret_cast<const char*>(first);
  const int64_t bytes = kWeightRows * groups * static_cast<int64_t>(sizeof(Scale));
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(begin + offset, _MM_HINT_T0);
}

// y[m0 .. m0 + XRows, n0 .. n0 + valid) from the weight rows `rows`.
//
// Each block's dot product is scaled by weight scale x activation scale; those products are
// formed first, eight blocks per multiply, so per block and row of x the inner loop is just
// maddubs, madd, convert and one FMA with a broadcast load of its scale.
template <int XRows, typename Weights>
void store_tile(const Problem<Weights>& p, const int64_t (&rows)[kWeightRows], int64_t m0,
                int64_t n0, int64_t valid) {
  constexpr int kPerUnit = Weights::kBlocksPerUnit;
  const typename Weights::Activation* xq[XRows];
  const float* xd[XRows];
  for (int i = 0; i < XRows; ++i) {
    xq[i] = p.x->values(m0 + i);
    xd[i] = p.x->scales(m0 + i);
  }
  const uint8_t* wrow[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) wrow[j] = p.values + rows[j] * p.units * kUnitBytes;
  __m256 acc[XRows][kWeightRows];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  alignas(32) float combined[kWeightRows][XRows][kScaleBlocks];
  const int64_t padded_blocks = p.units * kPerUnit;
  const int64_t next_tile = kPrefetchTiles * kWeightRows * p.units * kUnitBytes;
  prefetch_group_values(p.scales + (rows[0] + kPrefetchTiles * kWeightRows) * p.groups, p.groups);
  if (p.mins)
    prefetch_group_values(p.mins + (rows[0] + kPrefetchTiles * kWeightRows) * p.groups, p.groups);
  for (int64_t b0 = 0; b0 < padded_blocks; b0 += kScaleBlocks) {
    const int64_t count = std::min(kScaleBlocks, padded_blocks - b0);
    for (int j = 0; j < kWeightRows; ++j)
      combine_scales<XRows>(p.scales + rows[j] * p.groups, p.blocks, p.blocks_per_group, xd, b0,
                            count, combined[j]);
    for (int64_t b = 0; b < count; b += kPerUnit) {
      const int64_t unit = (b0 + b) / kPerUnit;
      for (int j = 0; j < kWeightRows; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(wrow[j] + unit * kUnitBytes + next_tile),
                     _MM_HINT_T0);
        const auto w = Weights::unpack(wrow[j] + unit * kUnitBytes);
        for (int half = 0; half < kPerUnit; ++half) {
          for (int i = 0; i < XRows; ++i) {
            const auto* x = xq[i] + (b0 + b + half) * kQuantBlock;
            const __m256 dots = _mm256_cvtepi32_ps(Weights::dot(w, half, x));
            const __m256 scale = _mm256_broadcast_ss(&combined[j][i][b + half]);
            acc[i][j] = _mm256_fmadd_ps(dots, scale, acc[i][j]);
          }
        }
      }
    }
  }
  // All kWeightRows sums first (a fixed trip count keeps acc in registers), then the valid ones.
  float sums[XRows][kWeightRows];
  for (int i = 0; i < XRows; ++i)
    for (int j = 0; j < kWeightRows; ++j) sums[i][j] = horizontal_sum(acc[i][j]);
  for (int i = 0; i < XRows; ++i) {
    float* out = p.y + (m0 + i) * p.n + n0;
    for (int64_t j = 0; j < valid; ++j) {
      float sum = sums[i][j];
      if constexpr (Weights::kHasMins)
        sum += dot_groups(p.mins + rows[j] * p.groups, p.group_sums + (m0 + i) * p.groups,
                          p.groups);
      out[j] = sum + (p.bias ? p.bias[n0 + j] : 0.0f);
    }
  }
}

// Columns n0 .. n0 + kWeightRows of rows [m_begin, m_end) of y. Past the last weight row the
// tile re-reads row n - 1 (already in cache) and drops those sums.
template <typename Weights>
void weight_tile(const Problem<Weights>& p, int64_t n0, int64_t m_begin, int64_t m_end) {
  int64_t rows[kWeightRows];
  for (int j = 0; j < kWeightRows; ++j) rows[j] = std::min<int64_t>(n0 + j, p.n - 1);
  const int64_t valid = std::min<int64_t>(kWeightRows, p.n - n0);
  int64_t m0 = m_begin;
  for (; m0 + kXRows <= m_end; m0 += kXRows) store_tile<kXRows>(p, rows, m0, n0, valid);
  for (; m0 < m_end; ++m0) store_tile<1>(p, rows, m0, n0, valid);
}

template <typename Weights>
at::Tensor run(Problem<Weights> p, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const at::Tensor xc = x.contiguous();
  p.m = x.size(0);
  const QuantizedRows<typename Weights::Activation> quantized(
      xc.data_ptr<float>(), p.m, x.size(1), p.units * Weights::kBlocksPerUnit);
  p.x = &quantized;
  std::vector<float> group_sums;
  if constexpr (Weights::kHasMins) {
    group_sums.assign(p.m * p.groups, 0.0f);
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t b = 0; b < p.blocks; ++b)
        group_sums[i * p.groups + b / p.blocks_per_group] += quantized.sums(i)[b];
    p.group_sums = group_sums.data();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == p.n,
                "quantized linear: bias must be a contiguous float32 [N]");
    p.bias = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({p.m, p.n}, x.options());
  p.y = y.data_ptr<float>();
  const int64_t tiles = (p.n + kWeightRows - 1) / kWeightRows;
#pragma omp parallel
  for (int64_t m_begin = 0; m_begin < p.m; m_begin += kXChunk) {
    const int64_t m_end = std::min(p.m, m_begin + kXChunk);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; ++t) weight_tile(p, t * kWeightRows, m_begin, m_end);
  }
  return y;
}

template <template <typename> class Format>
at::Tensor quantized_linear(const char* op, const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, op,
              ": x must be float32 [M, K] with K > 0");
  const int64_t k = x.size(1);
  const bool int4 = Format<float>::kHasMins;
  const at::ScalarType qdtype = int4 ? at::kByte : at::kChar;
  std::vector<at::Tensor> per_group{scales};
  if (mins.has_value()) per_group.push_back(*mins);
  check_packed_weight(op, qweight, qdtype, packed_row_bytes(k, int4), per_group, k, group_size);
  return with_scale_type(scales, [&](auto scale_type) {
    using Scale = std::remove_const_t<std::remove_pointer_t<decltype(scale_type)>>;
    Problem<Format<Scale>> p{};
    p.values = static_cast<const uint8_t*>(qweight.data_ptr());
    p.scales = scales.data_ptr<Scale>();
    p.mins = mins.has_value() ? mins->data_ptr<Scale>() : nullptr;
    p.n = qweight.size(0);
    p.blocks = (k + kQuantBlock - 1) / kQuantBlock;
    p.units = qweight.size(1) / kUnitBytes;
    p.groups = scales.size(1);
    p.blocks_per_group = group_size / kQuantBlock;
    return run(p, x, bias);
  });
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group_size, const std::optional<at::Tensor>& bias) {
  return quantized_linear<Int8Weights>("int8_linear", x, qweight, scales, std::nullopt,
                                       group_size, bias);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group_size,
                       const std::optional<at::Tensor>& bias) {
  return quantized_linear<Int4Weights>("int4_linear", x, qweight, scales, mins, group_size,
                                       bias);
}

}  // namespace tokenmill
