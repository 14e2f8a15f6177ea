// y = x W^T + b for a bfloat16 model's products, on a copy of W packed once at engine start: on
// AMX tiles where the CPU has them, else with AVX512-BF16 dot products or float32 FMAs on the
// widened weights (bfloat16_widen.inc), whichever the CPU runs faster; on an AVX2-only CPU, the
// FMAs.
//
// torch's bfloat16 product (oneDNN) streamed SmolLM2's weights slowly at every decode batch from
// 1 to 64 rows, about equally at each: set-up cost and a weight reorder per call, not
// arithmetic, bound it. Here each step of a product reads W as it lies.
//
// W is packed in the layout of AMX's B operand: per panel of 16 outputs, rows of k pairs, each
// row the 16 outputs' pairs (64 bytes). Every path multiplies bfloat16 pairs exactly and adds
// them into float32 sums, as torch's product does; only the order of the additions differs.
//
// AMX: one TDPBF16PS multiplies a 16 x 32 tile of x (A: 16 rows, 32 bfloat16 of k) by a 32 x 16
// tile of W (B: 16 outputs, 32 of k) into a 16 x 16 tile of float32 sums (C). Tiles: four sums
// C[2 x 2] (rows 0-15 and 16-31 of x by two panels of 16 outputs), two of x, two of W, the eight
// AMX has. A pass takes two adjacent panels and walks every 32 rows of x over them while the
// panels' bytes are still in L1/L2, so W is read from DRAM once per product whatever the batch.
// Rows of x past the last are zeros in the padded copy of x, and sums of zero rows cost nothing
// that matters next to W's stream.
//
// AVX512-BF16: one VDPBF16PS takes a panel's row (16 outputs' pairs) and one row of x's pair
// broadcast to every lane, and adds the two products into that row's 16 sums. A tile is up to 6
// rows of x by 4 panels, 24 sums in registers; a pass takes 4 panels and walks every 6 rows of x
// over them, W from DRAM in its first tile and from L2 after.
//
// Every path gives a row's sums the same steps whatever shares its tile, so a request decodes the
// same tokens alone and in a batch.
//
// Which path runs is chosen once (`bfloat16_products`): TOKENMILL_BF16_PRODUCTS=amx|dot|widen
// asks for one (a path this CPU cannot run is an error); unset, AMX where the CPU has it and
// Linux grants the tile state (arch_prctl, asked once), else the dot products where the CPU has
// AVX512-BF16 and is not an Intel one, else the widening path. The rule is the CPU's, not a
// timing's, so every process on a machine computes the same bits: Intel's cores without AMX
// issue VDPBF16PS on one port where they issue FMAs on two, so there the FMAs on widened weights
// are ahead; AMD's Zen 4 and later run VDPBF16PS at the FMA's rate, two products each, so there
// the dot products are. TOKENMILL_AVX512=0 leaves AMX and the dot products out and runs the
// widening path's AVX2 tiles.

#include <ATen/ATen.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "amx_tiles.h"
#include "kernels.h"
#include "prefetch.h"
#include "simd.h"

namespace tokenmill {
namespace {

constexpr int64_t kPanel = 16;  // outputs per panel of W (a C tile's 16 columns; a zmm of sums)
constexpr int64_t kDepth = 32;  // k per tile step: 32 bfloat16 = 64 bytes a tile row
constexpr int64_t kRowBlock = 2 * kTileRows;
constexpr int64_t kDotRows = 6;    // rows of x per dot-product tile
constexpr int64_t kDotPanels = 4;  // panels per dot-product tile

bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  return (edx & kAmxBf16) && (edx & kAmxTile);
}

bool cpu_has_avx512_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  constexpr unsigned kAvx512Bf16 = 1u << 5;
  return eax & kAvx512Bf16;
}

// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: without it the first tile instruction faults.
bool request_tile_state() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// One pass: rows [m0, m0 + 32) of x (padded, [Mp, Kp] bfloat16) by panels p and p + 1 (`pair`
// false: p alone), into `sums` [32, 32] float32.
[[gnu::target("amx-tile,amx-bf16")]] void tile_pass(const uint16_t* x, int64_t kp,
                                                    const uint16_t* w0, const uint16_t* w1,
                                                    bool pair, bool two_blocks, float* sums) {
  // The tile intrinsics take literal register numbers: sums of x rows 0-15 by panel 0 and 1 in
  // tmm0 and tmm1, of rows 16-31 in tmm2 and tmm3; x's two tiles in tmm4 and tmm5, W's in tmm6
  // and tmm7.
  const int64_t x_stride = kp * sizeof(uint16_t);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < kp; k += kDepth) {
    const int64_t w_offset = k * kPanel;  // k / 2 pair rows of 16 outputs x 2
    _tile_loadd(4, x + k, x_stride);
    _tile_loadd(6, w0 + w_offset, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_blocks) {
      _tile_loadd(5, x + kTileRows * kp + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (pair) {
      _tile_loadd(7, w1 + w_offset, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (two_blocks) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kSumStride = 2 * kPanel * sizeof(float);
  _tile_stored(0, sums, kSumStride);
  _tile_stored(1, sums + kPanel, kSumStride);
  _tile_stored(2, sums + kTileRows * 2 * kPanel, kSumStride);
  _tile_stored(3, sums + kTileRows * 2 * kPanel + kPanel, kSumStride);
}

// Row r's first `width` outputs: the sums plus the biases (none: nullptr), rounded to bfloat16
// (to nearest, ties to even, as torch rounds). Both paths end here.
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")]] void store_row(const float* sums,
                                                              const float* bias, int64_t width,
                                                              uint16_t* out) {
  for (int64_t c = 0; c < width; c += kPanel) {
    const auto lanes = static_cast<__mmask16>((1u << std::min<int64_t>(width - c, kPanel)) - 1);
    __m512 v = _mm512_loadu_ps(sums + c);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias + c));
    _mm256_mask_storeu_epi16(out + c, lanes, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows [0, Rows) of x (padded to kp, rows kp apart) by panels [0, Panels) of W (`panel_elements`
// apart), into y's rows (n apart) from output n0: the first `width` outputs of the panels.
// Every sum adds its k pairs in order, one VDPBF16PS each, whatever the tile's shape.
template <int Rows, int Panels>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")]] void dot_tile(
    const uint16_t* x, int64_t kp, const uint16_t* w, int64_t panel_elements, const float* bias,
    int64_t width, uint16_t* y, int64_t n) {
  __m512 c[Rows][Panels];
#pragma GCC unroll 24
  for (int i = 0; i < Rows * Panels; ++i) c[i / Panels][i % Panels] = _mm512_setzero_ps();
  const int64_t pairs = kp / 2;
  const auto* x_pairs = reinterpret_cast<const int32_t*>(x);
#pragma GCC unroll 2
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh row[Panels];
#pragma GCC unroll 4
    for (int p = 0; p < Panels; ++p)
      row[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_elements + j * 2 * kPanel);
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      const auto pair = (__m512bh)_mm512_set1_epi32(x_pairs[r * pairs + j]);
#pragma GCC unroll 4
      for (int p = 0; p < Panels; ++p) c[r][p] = _mm512_dpbf16_ps(c[r][p], pair, row[p]);
    }
  }
  alignas(64) float sums[Panels * kPanel];
  for (int r = 0; r < Rows; ++r) {
    for (int p = 0; p < Panels; ++p) _mm512_store_ps(sums + p * kPanel, c[r][p]);
    store_row(sums, bias, width, y + r * n);
  }
}

using DotTile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                         int64_t, uint16_t*, int64_t);

template <int Panels, int... Rows>
constexpr std::array<DotTile, sizeof...(Rows)> dot_tiles(std::integer_sequence<int, Rows...>) {
  return {&dot_tile<Rows + 1, Panels>...};
}

// kDotTiles[panels - 1][rows - 1]: the tile for up to kDotRows rows by up to kDotPanels panels.
constexpr std::array<std::array<DotTile, kDotRows>, kDotPanels> kDotTiles = {
    dot_tiles<1>(std::make_integer_sequence<int, kDotRows>{}),
    dot_tiles<2>(std::make_integer_sequence<int, kDotRows>{}),
    dot_tiles<3>(std::make_integer_sequence<int, kDotRows>{}),
    dot_tiles<4>(std::make_integer_sequence<int, kDotRows>{})};

void amx_linear_passes(const uint16_t* xs, int64_t m, int64_t kp, const uint16_t* ws,
                       int64_t panels, const float* bias, uint16_t* ys, int64_t n) {
  const int64_t panel_elements = kp * kPanel;
  const int64_t passes = (panels + 1) / 2;
  configure_tiles();
  alignas(64) float sums[kRowBlock * 2 * kPanel];
#pragma omp for schedule(static)
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t p = 2 * pass;
    const bool pair = p + 1 < panels;
    const int64_t n0 = p * kPanel, width = std::min<int64_t>(n - n0, 2 * kPanel);
    const uint16_t* w0 = ws + p * panel_elements;
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t rows = std::min<int64_t>(m - m0, kRowBlock);
      tile_pass(xs + m0 * kp, kp, w0, pair ? w0 + panel_elements : w0, pair, rows > kTileRows,
                sums);
      for (int64_t r = 0; r < rows; ++r)
        store_row(sums + r * 2 * kPanel, bias == nullptr ? nullptr : bias + n0, width,
                  ys + (m0 + r) * n + n0);
    }
  }
  release_tiles();
}

void dot_linear_passes(const uint16_t* xs, int64_t m, int64_t kp, const uint16_t* ws,
                       int64_t panels, const float* bias, uint16_t* ys, int64_t n) {
  const int64_t panel_elements = kp * kPanel;
  const int64_t passes = (panels + kDotPanels - 1) / kDotPanels;
#pragma omp for schedule(static)
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t p = pass * kDotPanels, count = std::min(kDotPanels, panels - p);
    const int64_t n0 = p * kPanel, width = std::min(n - n0, count * kPanel);
    for (int64_t m0 = 0; m0 < m; m0 += kDotRows) {
      const int64_t rows = std::min(kDotRows, m - m0);
      kDotTiles[count - 1][rows - 1](xs + m0 * kp, kp, ws + p * panel_elements, panel_elements,
                                     bias == nullptr ? nullptr : bias + n0, width,
                                     ys + m0 * n + n0, n);
    }
  }
}

#include "bfloat16_widen.inc"

bool cpu_is_intel() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[12];
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::memcmp(vendor, "GenuineIntel", 12) == 0;
}

enum class Bfloat16Products { kAmx, kDot, kWiden };

bool dot_products_run() { return avx512_usable() && cpu_has_avx512_bf16(); }

Bfloat16Products choose_bfloat16_products() {
  const char* setting = std::getenv("TOKENMILL_BF16_PRODUCTS");
  const std::string choice = setting == nullptr ? "" : setting;
  if (choice.empty()) {
    if (amx_available()) return Bfloat16Products::kAmx;
    return dot_products_run() && !cpu_is_intel() ? Bfloat16Products::kDot
                                                 : Bfloat16Products::kWiden;
  }
  if (choice == "amx") {
    TORCH_CHECK_VALUE(amx_available(),
                      "TOKENMILL_BF16_PRODUCTS=amx, but this CPU or OS does not run AMX tiles "
                      "(or TOKENMILL_AVX512=0)");
    return Bfloat16Products::kAmx;
  }
  if (choice == "dot") {
    TORCH_CHECK_VALUE(dot_products_run(),
                      "TOKENMILL_BF16_PRODUCTS=dot, but this CPU has no AVX512-BF16 (or "
                      "TOKENMILL_AVX512=0)");
    return Bfloat16Products::kDot;
  }
  TORCH_CHECK_VALUE(choice == "widen", "TOKENMILL_BF16_PRODUCTS=", choice,
                    " is none of amx, dot, widen");
  return Bfloat16Products::kWiden;
}

// The path every bfloat16 product of this process takes, chosen once.
Bfloat16Products bfloat16_path() {
  static const Bfloat16Products chosen = choose_bfloat16_products();
  return chosen;
}

}  // namespace

bool amx_available() {
  static const bool available = avx512_allowed() && cpu_has_amx_bf16() && request_tile_state();
  return available;
}

std::string bfloat16_products() {
  switch (bfloat16_path()) {
    case Bfloat16Products::kAmx:
      return "amx";
    case Bfloat16Products::kDot:
      return "dot";
    case Bfloat16Products::kWiden:
      break;
  }
  return "widen";
}

at::Tensor pack_bfloat16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bfloat16_weight: weight must be bfloat16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, kp = (k + kDepth - 1) / kDepth * kDepth;
  // Zeros pad N to whole panels and K to whole tile steps, so the tiles never branch.
  at::Tensor padded = at::zeros({panels * kPanel, kp}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [panel, output, k/2, 2] -> [panel, k/2, output, 2]: a tile row holds 16 outputs' k pair.
  return padded.view({panels, kPanel, kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

// Rows of the padded copy of x: AMX's tiles read whole blocks of 32 rows, the dot products only
// the rows there are.
int64_t padded_rows(int64_t m) {
  return bfloat16_path() == Bfloat16Products::kAmx ? (m + kRowBlock - 1) / kRowBlock * kRowBlock
                                                   : m;
}

}  // namespace

int64_t bfloat16_linear_scratch_bytes(int64_t m, int64_t k) {
  const int64_t kp = (k + kDepth - 1) / kDepth * kDepth;
  if (bfloat16_path() == Bfloat16Products::kWiden) return widened_x_bytes(m, kp);
  return padded_rows(m) * kp * sizeof(uint16_t);
}

void bfloat16_linear_team(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                          const at::Tensor& y, void* scratch) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  const int64_t panels = packed.size(0), kp = packed.size(1) * 2;
  const auto* ws = static_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = static_cast<uint16_t*>(y.data_ptr());
  if (bfloat16_path() == Bfloat16Products::kWiden) {
    static const WidenShapes& shapes = avx512_usable() ? kWiden512 : kWiden256;
    widen_linear_passes(shapes, static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), m, k,
                        kp, ws, panels, bias, ys, n, static_cast<float*>(scratch));
    return;
  }
  // x with k padded to the packed depth (and for AMX rows to a multiple of 32), zeros past both:
  // W's padding is zeros too, and a zero times anything not finite would be NaN.
  const int64_t mp = padded_rows(m);
  auto* xs = static_cast<uint16_t*>(scratch);
  const auto* x_rows = static_cast<const uint16_t*>(x.data_ptr());
#pragma omp for schedule(static)
  for (int64_t r = 0; r < mp; ++r) {
    uint16_t* row = xs + r * kp;
    const int64_t copied = r < m ? k : 0;
    if (copied > 0) std::memcpy(row, x_rows + r * x.stride(0), k * sizeof(uint16_t));
    std::memset(row + copied, 0, (kp - copied) * sizeof(uint16_t));
  }
  if (bfloat16_path() == Bfloat16Products::kAmx)
    amx_linear_passes(xs, m, kp, ws, panels, bias, ys, n);
  else
    dot_linear_passes(xs, m, kp, ws, panels, bias, ys, n);
}

void check_bfloat16_linear_weight(const char* op, const at::Tensor& packed, int64_t n,
                                  int64_t k) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous(),
              op, ": packed must come from pack_bfloat16_weight");
  const int64_t panels = packed.size(0), kp = packed.size(1) * 2;
  TORCH_CHECK(k <= kp && kp - k < kDepth, op, ": x and weight disagree on K");
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, op,
              ": n does not match the packed weight");
}

at::Tensor bfloat16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "bfloat16_linear: x must be bfloat16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  check_bfloat16_linear_weight("bfloat16_linear", packed, n, k);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == n,
                "bfloat16_linear: bias must be a contiguous bfloat16 [N]");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const at::Tensor wide_bias = bias ? bias->to(at::kFloat) : at::Tensor();
  at::Tensor scratch =
      at::empty({bfloat16_linear_scratch_bytes(m, k)}, x.options().dtype(at::kByte));
#pragma omp parallel
  bfloat16_linear_team(xc, packed, bias ? wide_bias.data_ptr<float>() : nullptr, y,
                       scratch.data_ptr());
  return y;
}

}  // namespace tokenmill
