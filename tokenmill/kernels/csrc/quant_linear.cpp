// y = x W^T + b for fp32 x and int8 or int4 weights regrouped into panels of 8 output rows, so
// that each 32-bit lane of a vector belongs to one output row (ops.pack_int4_panels and
// ops.pack_int8_panels make them from the row-major checkpoint format):
//   int4: per panel and block of 32 inputs, 128 bytes: four vectors, vector v holding for row r
//         in lane r the codes of inputs 8v .. 8v + 3 in the low nibbles of its 4 bytes and
//         8v + 4 .. 8v + 7 in the high ones. w = scale * q + min.
//   int8: per panel and block, 256 bytes: sixteen 16-byte units, unit u holding for row r the
//         codes of inputs 2u and 2u + 1 in bytes 2r and 2r + 1. w = scale * q.
//   scales (and mins) [panels, groups, 8], fp16 or fp32: one per row of the panel and group.
//
// x is quantized per block of 32 (QuantizedRows). A block's integer products then land in the
// lanes of their output rows, with no horizontal sums: for int4, _mm256_maddubs_epi16 of the
// nibbles with four broadcast int8 activations gives each row's pair sums, eight of those add
// up exactly in int16 (8 * 2 * 15 * 127 < 2^15), and one _mm256_madd_epi16 widens them; int8
// codes widen to int16 and _mm256_madd_epi16 multiplies them by pairs of int16 activations. One
// FMA a block then scales the 8 rows' sums by their weight scales times the block's x scale.
// Where the CPU has AVX-512 VNNI, vpdpbusd and vpdpwssd multiply and add into the int32 sums in
// one instruction each, and zmm vectors take two panels a pass (quant_panels.inc, compiled for
// both): the same sums in fewer instructions, a gain that grows with the rows of x.
// The per-row reductions, scale combining and stores of a row-major kernel disappear: at one
// row of x, large matrices stream well ahead of the row-major kernel. A panel is one contiguous stream, read once per call: every row of x is multiplied
// while the panel is in L1, four rows at a time (the int4 pass of four keeps some values on the
// stack, but passes of two or three measured no faster).
// This is llama.cpp's repacked "Q4_0 8x8" idea (weights interleaved across rows for SIMD lanes),
// applied to our int4 and int8 formats.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "kquant.h"
#include "quant.h"
#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

constexpr int64_t kPanelRows = 8;
// Rows of x per pass over a panel, each weight vector unpacked once for all of them.
constexpr int kXRows = 4;
// Each block's bytes this far ahead are prefetched: a thread's panels are one stream, but the
// hardware prefetcher stops at every 4 KB page (measured on the Q8_0 LM head; 1 and 4 KB ahead
// did no better).
constexpr int64_t kPrefetchBytes = 2048;

// Four consecutive activation bytes (or two int16) as one 32-bit value, for every lane of a
// vector.
template <typename T>
inline int32_t four_bytes(const T* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
inline __m256i broadcast_pair32(const T* p) {
  return _mm256_set1_epi32(four_bytes(p));
}

// The two weight formats' layouts; their block products are in quant_panels.inc.
template <typename ScaleT>
struct Int4Panels {
  using Scale = ScaleT;
  using Activation = int8_t;
  static constexpr bool kHasMins = true;
  static constexpr int64_t kBlockBytes = kPanelRows * kQuantBlock / 2;
  // Rows of x from which VNNI passes take two panels at once (below, one: a single stream reads
  // a bandwidth-bound product faster). Over SmolLM2's int4 layer products two panels tie with one
  // at one row of x and win from two rows on.
  static constexpr int64_t kPairMinRows = 2;
  static constexpr int kCodeOffset = 0;  // the min is a tensor of its own
  static constexpr bool kFifthBits = false;
};

// GGUF's Q5_0 kept at its 5.5 bits a weight: int4's nibbles plus a vector of fifth bits a block
// (quant_panels.inc), codes q in 0..31 and one scale d a block, w = d * (q - 16): int4's
// arithmetic with the min -16 * d made from the scale (exact in fp32) instead of read.
template <typename ScaleT>
struct Q50Panels {
  using Scale = ScaleT;
  using Activation = int8_t;
  static constexpr bool kHasMins = true;
  static constexpr int64_t kBlockBytes = kPanelRows * kQuantBlock * 5 / 8;
  static constexpr int64_t kPairMinRows = 2;
  static constexpr int kCodeOffset = -16;
  static constexpr bool kFifthBits = true;
};

template <typename ScaleT>
struct Int8Panels {
  using Scale = ScaleT;
  using Activation = int16_t;
  static constexpr bool kHasMins = false;
  static constexpr int64_t kBlockBytes = kPanelRows * kQuantBlock;
  // On the Q8_0 LM head (49,152 x 576) one panel wins at one and two rows of x, the two are even
  // around three and four, and two panels win from there on.
  static constexpr int64_t kPairMinRows = 3;
  static constexpr int kCodeOffset = 0;
  static constexpr bool kFifthBits = false;
};

template <typename Weights>
struct Problem {
  using Scale = typename Weights::Scale;
  const QuantizedRows<typename Weights::Activation>* x;
  const uint8_t* values;    // [panels, blocks * kBlockBytes]
  const Scale* scales;      // [panels, groups, 8]
  const Scale* mins;        // [panels, groups, 8] for int4, else nullptr (q5_0's come from scales)
  const float* bias;        // [n] or nullptr
  float* y;                 // [m, n]
  int64_t m, n, blocks, groups, blocks_per_group;
};

// The panel kernels, compiled twice: for AVX2 (every CPU the library runs on), and for AVX-512
// VNNI, whose dot-product instructions add a lane's four byte products (vpdpbusd) or two int16
// products (vpdpwssd) straight into its int32 sum, where AVX2 multiplies, then adds or widens,
// and whose zmm vectors take two panels a pass. The integer sums are exact either way, so both
// give bit-identical outputs.
namespace avx2 {
#define TOKENMILL_VNNI 0
#include "quant_panels.inc"
#undef TOKENMILL_VNNI
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define TOKENMILL_VNNI 1
#include "quant_panels.inc"
#undef TOKENMILL_VNNI
}  // namespace vnni
#pragma GCC pop_options

// Whether the VNNI kernels run: the CPU has them, and TOKENMILL_AVX512 is not "0" (the switch
// that measures them against AVX2 on one machine).
const bool kUseVnni = avx512_usable(/*vnni=*/true);

// Checks the panel tensors against the n outputs of k inputs they hold.
void check_panels(const char* op, const at::Tensor& values, int64_t block_bytes,
                  const std::vector<at::Tensor>& per_group, int64_t n, int64_t k,
                  int64_t group_size) {
  check_group_size(op, group_size);
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  const int64_t blocks = (k + kQuantBlock - 1) / kQuantBlock;
  const int64_t groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kByte && values.is_contiguous() &&
                  values.size(0) == panels && values.size(1) == blocks * block_bytes,
              op, ": values must be contiguous uint8 [", panels, ", ", blocks * block_bytes,
              "] for ", n, " outputs of ", k, " inputs");
  for (const at::Tensor& t : per_group)
    TORCH_CHECK(t.scalar_type() == per_group[0].scalar_type() && t.is_contiguous() &&
                    t.dim() == 3 && t.size(0) == panels && t.size(1) == groups &&
                    t.size(2) == kPanelRows,
                op, ": scales/mins must be contiguous [", panels, ", ", groups, ", 8] of one dtype");
}

// The product over the enclosing parallel region's threads: x quantized into `scratch`, then the
// panels shared out.
template <template <typename> class Format>
void panel_linear_team(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor* mins, int64_t group_size, const float* bias,
                       const at::Tensor& y, void* scratch) {
  with_scale_type(scales, [&](auto scale_type) {
    using Scale = std::remove_const_t<std::remove_pointer_t<decltype(scale_type)>>;
    using Weights = Format<Scale>;
    Problem<Weights> p{};
    p.values = values.data_ptr<uint8_t>();
    p.scales = scales.data_ptr<Scale>();
    p.mins = mins != nullptr ? mins->data_ptr<Scale>() : nullptr;
    p.bias = bias;
    p.y = y.data_ptr<float>();
    p.m = x.size(0);
    p.n = y.size(1);
    p.blocks = (x.size(1) + kQuantBlock - 1) / kQuantBlock;
    p.groups = scales.size(1);
    p.blocks_per_group = group_size / kQuantBlock;
    QuantizedRows<typename Weights::Activation> quantized(scratch, p.m, p.blocks);
    quantized.quantize(x.data_ptr<float>(), p.m, x.size(1));
    p.x = &quantized;
    const int64_t panels = (p.n + kPanelRows - 1) / kPanelRows;
    // With VNNI, a pass takes two panels once x has enough rows (an odd last one alone).
    const int64_t step = kUseVnni && p.m >= Weights::kPairMinRows ? 2 : 1;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (panels + step - 1) / step; ++t) {
      const int64_t first = t * step;
      if (!kUseVnni)
        avx2::panels<avx2::OnePanel>(p, first);
      else if (step == 2 && first + 1 < panels)
        vnni::panels<vnni::TwoPanels>(p, first);
      else
        vnni::panels<vnni::OnePanel>(p, first);
    }
  });
}

template <template <typename> class Format>
int64_t scratch_bytes(int64_t m, int64_t k) {
  using Activation = typename Format<float>::Activation;
  return QuantizedRows<Activation>::storage_bytes(m, (k + kQuantBlock - 1) / kQuantBlock);
}

// Checks, allocates y and the scratch, and runs the product on a parallel region of its own.
template <template <typename> class Format>
at::Tensor panel_linear(const char* op, const at::Tensor& x, const at::Tensor& values,
                        const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                        int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, op,
              ": x must be float32 [M, K] with K > 0");
  std::vector<at::Tensor> per_group{scales};
  if (mins.has_value()) per_group.push_back(*mins);
  check_panels(op, values, Format<float>::kBlockBytes, per_group, n, x.size(1), group_size);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                op, ": bias must be a contiguous float32 [N]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  at::Tensor scratch =
      at::empty({scratch_bytes<Format>(x.size(0), x.size(1))}, x.options().dtype(at::kByte));
#pragma omp parallel
  panel_linear_team<Format>(xc, values, scales, mins.has_value() ? &*mins : nullptr, group_size,
                            bias.has_value() ? bias->data_ptr<float>() : nullptr, y,
                            scratch.data_ptr());
  return y;
}

}  // namespace

void check_int8_panels(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t k, int64_t group_size) {
  check_panels(op, values, Int8Panels<float>::kBlockBytes, {scales}, n, k, group_size);
}

void check_int4_panels(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t n, int64_t k, int64_t group_size) {
  check_panels(op, values, Int4Panels<float>::kBlockBytes, {scales, mins}, n, k, group_size);
}

void check_q5_0_panels(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t k) {
  check_panels(op, values, Q50Panels<float>::kBlockBytes, {scales}, n, k, kQuantBlock);
}

int64_t q5_0_linear_scratch_bytes(int64_t m, int64_t k) { return scratch_bytes<Q50Panels>(m, k); }

void q5_0_linear_team(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                      const float* bias, const at::Tensor& y, void* scratch) {
  panel_linear_team<Q50Panels>(x, values, scales, nullptr, kQuantBlock, bias, y, scratch);
}

at::Tensor q5_0_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(group_size == kQuantBlock, "q5_0_linear: Q5_0 blocks are groups of 32, got ",
              group_size);
  return panel_linear<Q50Panels>("q5_0_linear", x, values, scales, std::nullopt, n, group_size,
                                 bias);
}

int64_t int8_linear_scratch_bytes(int64_t m, int64_t k) { return scratch_bytes<Int8Panels>(m, k); }

int64_t int4_linear_scratch_bytes(int64_t m, int64_t k) { return scratch_bytes<Int4Panels>(m, k); }

void int8_linear_team(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                      int64_t group_size, const float* bias, const at::Tensor& y, void* scratch) {
  panel_linear_team<Int8Panels>(x, values, scales, nullptr, group_size, bias, y, scratch);
}

void int4_linear_team(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                      const at::Tensor& mins, int64_t group_size, const float* bias,
                      const at::Tensor& y, void* scratch) {
  panel_linear_team<Int4Panels>(x, values, scales, &mins, group_size, bias, y, scratch);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias) {
  return panel_linear<Int8Panels>("int8_linear", x, values, scales, std::nullopt, n, group_size,
                                  bias);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t n, int64_t group_size,
                       const std::optional<at::Tensor>& bias) {
  return panel_linear<Int4Panels>("int4_linear", x, values, scales, mins, n, group_size, bias);
}

}  // namespace tokenmill
