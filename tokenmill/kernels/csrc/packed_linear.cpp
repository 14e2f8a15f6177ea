// y = x W^T + b on a copy of W packed once at engine start, for every float32 product of a
// decode step and short prefills (1 to 256 rows of x).
//
// W is packed as panels of 16 output rows, k-major ([N / 16, K, 16]), so every read of it runs
// forward through memory and 16 outputs take two ymm loads per step of k.
//
// One to three rows of x (decode of a few sequences, a short speculative verification) are
// bound by DRAM: narrow_tile streams two to four panels at once, each weight vector serving all
// the rows. One row reads SmolLM2's layer weights markedly faster this way than the skinny
// kernel on the plain [N, K] weight (rows of W, horizontal sums at the end) does.
//
// From four rows on, arithmetic bounds the product and the classic register tile keeps both FMA
// pipes busy: 6 rows of x by 16 outputs in 12 ymm accumulators, so every step of k loads two
// vectors of W and six broadcasts of x and issues 12 independent FMAs, enough to cover the FMA
// latency. Each call packs its x the same way, 6 rows per chunk ([M / 6, K, 6], zero rows
// padding the last chunk). On SmolLM2's products at 24-256 rows this tile ran ahead of oneDNN's
// GEMM on its own blocked copy, in the same runs.
//
// The tile's 12 accumulators are named variables, not an array: with an array there GCC kept
// them in memory and stored all twelve on every step of k, which halved the speed.
//
// On a CPU with AVX-512 (checked once at run time: the build targets AVX2, so one library runs
// on every CPU here) the tile takes two panels at once, a panel's 16 outputs being one zmm
// vector, and two chunks of x (12 rows, 24 accumulators). Every output lane still runs the same
// FMAs in the same order of k, so its result is bit-identical to the AVX2 tile's. With weights
// in cache, even before the two-chunk tile, it beat both the AVX2 tile and oneDNN's 512-bit
// GEMM on its packed copy over SmolLM2's layer products at 16 and 64 rows.
//
// Products of 1 to 9 rows (a decode of a few streams, a speculative verification) take the
// few-rows tiles instead where AVX-512 runs (see there): no padding rows, and more panels
// streaming at once the fewer the rows. Their outputs are the other tiles' bits too.
//
// A decode step's weights come from DRAM, though, and there the tile's wide products were
// slower than arithmetic and memory would explain: the first tile call over a panel waited on
// DRAM, the calls after it computed from L2 while DRAM sat idle. Software prefetches
// (prefetch.h) now keep the next panels arriving during that arithmetic, which shortened all
// of SmolLM2's products with weights from DRAM at every row count measured (8 to 128), on the
// AVX2 tile (TOKENMILL_AVX512=0) too.

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <optional>
#include <utility>

#include "kernels.h"
#include "prefetch.h"
#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

constexpr int64_t kPanel = 16;  // outputs per panel of the packed weight: two ymm vectors
constexpr int64_t kChunk = 6;   // rows of x per register tile
// Rows of x per pass over the weight, so a pass's packed x (up to 96 x 1536 floats, 576 KB)
// stays in L2 while every panel reads it.
constexpr int64_t kRowsPerPass = 96;

// A panel's 16 biases as two vectors: 0 past its last output (`valid` of them) and without a
// bias, and never read past the bias's end.
struct PanelBias {
  __m256 lo, hi;
};

PanelBias panel_bias(const float* bias, int64_t valid) {
  alignas(32) float b[kPanel] = {};
  if (bias != nullptr) std::copy_n(bias, valid, b);
  return {_mm256_load_ps(b), _mm256_load_ps(b + 8)};
}

// y[0, valid) = one row's 16 sums of a panel plus its biases. Both tiles end here, so a row's
// outputs take the same last add whichever tile computed them.
void store_outputs(__m256 lo, __m256 hi, const PanelBias& bias, float* y, int64_t valid) {
  lo = _mm256_add_ps(lo, bias.lo);
  hi = _mm256_add_ps(hi, bias.hi);
  if (valid == kPanel) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float row[kPanel];  // the last panel of an N that is not a multiple of 16
  _mm256_store_ps(row, lo);
  _mm256_store_ps(row + 8, hi);
  std::copy_n(row, valid, y);
}

// out[i] (i < rows) = 16 outputs of row i of the chunk, from the packed chunk x [K, 6] and
// panel w [K, 16].
void tile(const float* x, const float* w, int64_t k, const float* bias, float* y, int64_t ldy,
          int64_t rows, int64_t valid, PassPrefetch ahead) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // Unrolled: the loop's own counter and pointer updates otherwise take issue slots.
#pragma GCC unroll 4
  for (int64_t i = 0; i < k; ++i, x += kChunk, w += kPanel) {
    const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
    ahead.own(w, kPanel * sizeof(float));
    ahead.next_step();
    __m256 a = _mm256_broadcast_ss(x);
    c00 = _mm256_fmadd_ps(a, w0, c00);
    c01 = _mm256_fmadd_ps(a, w1, c01);
    a = _mm256_broadcast_ss(x + 1);
    c10 = _mm256_fmadd_ps(a, w0, c10);
    c11 = _mm256_fmadd_ps(a, w1, c11);
    a = _mm256_broadcast_ss(x + 2);
    c20 = _mm256_fmadd_ps(a, w0, c20);
    c21 = _mm256_fmadd_ps(a, w1, c21);
    a = _mm256_broadcast_ss(x + 3);
    c30 = _mm256_fmadd_ps(a, w0, c30);
    c31 = _mm256_fmadd_ps(a, w1, c31);
    a = _mm256_broadcast_ss(x + 4);
    c40 = _mm256_fmadd_ps(a, w0, c40);
    c41 = _mm256_fmadd_ps(a, w1, c41);
    a = _mm256_broadcast_ss(x + 5);
    c50 = _mm256_fmadd_ps(a, w0, c50);
    c51 = _mm256_fmadd_ps(a, w1, c51);
  }
  const __m256 sums[kChunk][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                                  {c30, c31}, {c40, c41}, {c50, c51}};
  const PanelBias panel = panel_bias(bias, valid);
  for (int64_t r = 0; r < rows; ++r)
    store_outputs(sums[r][0], sums[r][1], panel, y + r * ldy, valid);
}

// The tile over panels a and b (adjacent; b's last `valid` outputs real) with zmm vectors, for
// `Chunks` chunks of x at once (x[h], rows[h] real rows each): with two, 24 accumulators, and
// each pair of weight vectors loaded serves 12 rows instead of 6, which sped up SmolLM2's
// products at 64 rows with weights in cache. Arrays are fine here: fully unrolled, GCC keeps all
// 24 in registers.
template <int Chunks>
[[gnu::target("avx512f,avx512dq")]] void tile_pair(const float* const (&x)[Chunks],
                                                   const int64_t (&rows)[Chunks], const float* a,
                                                   const float* b, int64_t k, const float* bias,
                                                   float* y, int64_t ldy, int64_t valid,
                                                   PassPrefetch ahead) {
  __m512 c[Chunks][kChunk][2];
#pragma GCC unroll 12
  for (int j = 0; j < Chunks * kChunk; ++j)
    c[j / kChunk][j % kChunk][0] = c[j / kChunk][j % kChunk][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < k; ++i, a += kPanel, b += kPanel) {
    const __m512 w0 = _mm512_loadu_ps(a), w1 = _mm512_loadu_ps(b);
    ahead.own(a, kPanel * sizeof(float));
    ahead.own(b, kPanel * sizeof(float));
    ahead.next_step();
#pragma GCC unroll 2
    for (int h = 0; h < Chunks; ++h) {
#pragma GCC unroll 6
      for (int r = 0; r < kChunk; ++r) {
        const __m512 v = _mm512_set1_ps(x[h][i * kChunk + r]);
        c[h][r][0] = _mm512_fmadd_ps(v, w0, c[h][r][0]);
        c[h][r][1] = _mm512_fmadd_ps(v, w1, c[h][r][1]);
      }
    }
  }
  const PanelBias first = panel_bias(bias, kPanel);
  const PanelBias second = panel_bias(bias == nullptr ? nullptr : bias + kPanel, valid);
  for (int h = 0; h < Chunks; ++h)
    for (int64_t r = 0; r < rows[h]; ++r) {
      const __m512 s0 = c[h][r][0], s1 = c[h][r][1];
      float* out = y + (h * kChunk + r) * ldy;
      store_outputs(_mm512_castps512_ps256(s0), _mm512_extractf32x8_ps(s0, 1), first, out,
                    kPanel);
      store_outputs(_mm512_castps512_ps256(s1), _mm512_extractf32x8_ps(s1, 1), second,
                    out + kPanel, valid);
    }
}

// Panels per step of the wide path: two where tile_pair can run.
const int64_t kTilePanels = avx512_usable() ? 2 : 1;

// `Rows` (1 to 3) rows of x against Panels adjacent panels, for products too narrow to fill the
// tile, which would spend most of its FMAs on padding and read one weight stream at a time.
// Each output's arithmetic is the tile's, step for step (the same FMAs in the same order of k,
// then the same bias add), so a row's outputs are bit-identical whatever other rows share its
// product: a request decodes the same alone and in a batch. Several panels at once keep enough
// loads in flight for DRAM's bandwidth, and every weight vector loaded serves all the rows.
template <int Rows, int Panels>
void narrow_tile(const float* x, const float* w, int64_t k, const float* bias, float* y,
                 int64_t n, int64_t first_panel) {
  __m256 c[Rows][Panels][2];
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels; ++p) c[r][p][0] = c[r][p][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < k; ++i) {
    __m256 a[Rows];
    for (int r = 0; r < Rows; ++r) a[r] = _mm256_broadcast_ss(x + r * k + i);
    for (int p = 0; p < Panels; ++p) {
      const float* panel = w + (p * k + i) * kPanel;
      const __m256 w0 = _mm256_load_ps(panel), w1 = _mm256_load_ps(panel + 8);
      for (int r = 0; r < Rows; ++r) {
        c[r][p][0] = _mm256_fmadd_ps(a[r], w0, c[r][p][0]);
        c[r][p][1] = _mm256_fmadd_ps(a[r], w1, c[r][p][1]);
      }
    }
  }
  for (int p = 0; p < Panels; ++p) {
    const int64_t n0 = (first_panel + p) * kPanel, valid = std::min(kPanel, n - n0);
    const PanelBias panel = panel_bias(bias == nullptr ? nullptr : bias + n0, valid);
    for (int r = 0; r < Rows; ++r)
      store_outputs(c[r][p][0], c[r][p][1], panel, y + r * n + n0, valid);
  }
}

// Panels per narrow_tile call for each row count: at most 12 accumulators, as in the tile.
template <int Rows>
constexpr int64_t kNarrowPanels = Rows == 1 ? 4 : Rows == 2 ? 3 : 2;
// Up to this many rows of x, the product runs on narrow_tile. Three rows did too with the AVX2
// tile; the 512-bit one takes them faster (measured over all of SmolLM2's products).
const int64_t kNarrowMaxRows = kTilePanels == 2 ? 2 : 3;

// narrow_tile over `count` <= Panels panels: only the last group of a product is short.
template <int Rows, int Panels>
void narrow_group(int64_t count, const float* x, const float* w, int64_t k, const float* bias,
                  float* y, int64_t n, int64_t first_panel) {
  if constexpr (Panels > 1) {
    if (count < Panels)
      return narrow_group<Rows, Panels - 1>(count, x, w, k, bias, y, n, first_panel);
  }
  narrow_tile<Rows, Panels>(x, w, k, bias, y, n, first_panel);
}

template <int Rows>
void narrow_product(const float* x, int64_t k, const float* w, int64_t panels,
                    const float* bias, float* y, int64_t n) {
  constexpr int64_t kGroup = kNarrowPanels<Rows>;
  const int64_t groups = (panels + kGroup - 1) / kGroup;
#pragma omp for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * kGroup;
    narrow_group<Rows, kGroup>(std::min(kGroup, panels - first), x, w + first * k * kPanel, k,
                               bias, y, n, first);
  }
}

// The few-rows tiles (AVX-512) take every product of 1 to kFewRowsMax rows: x's rows by up to 4
// adjacent panels, one zmm sum per row and panel. They compute no padding rows (the 12-row zmm
// tile spends a quarter of its FMAs on them at 9 rows, a third at 8), and the fewer the rows,
// the more panels stream from memory at once (4 up to 6 rows, 3 up to 9), which is what a
// product bound by DRAM needs: over SmolLM2's products with weights from DRAM they beat the
// narrow and the 12-row tiles at 1 to 9 rows. Past 9 rows they would be little more than the
// 12-row tile without its padding, which measured no faster, so the bound stops there.
// TOKENMILL_FEW_ROW_TILES=0 leaves them out (the baseline).
constexpr int64_t kFewRowsMax = kFewRowTileRows;
constexpr int64_t kFewMaxPanels = few_row_tile_panels(1);

const bool kFewRowTiles = avx512_usable() && few_row_tiles_allowed();

bool few_rows_run(int64_t m) { return kFewRowTiles && m >= 1 && m <= kFewRowsMax; }

// `Rows` rows of x (packed k-major, [k, Rows]) by `Panels` adjacent panels of W, into y's rows
// (`ldy` apart); the last panel has `valid` real outputs. Each output's sum takes its k in order,
// one FMA each, then the bias, as in the other tiles, so its bits do not depend on the tile.
template <int Rows, int Panels>
[[gnu::target("avx512f,avx512dq")]] void few_rows_tile(const float* x, const float* w, int64_t k,
                                                       const float* bias, float* y, int64_t ldy,
                                                       int64_t valid, PassPrefetch ahead) {
  __m512 c[Rows][Panels];
#pragma GCC unroll 24
  for (int j = 0; j < Rows * Panels; ++j) c[j / Panels][j % Panels] = _mm512_setzero_ps();
  const float* panel[Panels];
#pragma GCC unroll 4
  for (int p = 0; p < Panels; ++p) panel[p] = w + p * k * kPanel;
#pragma GCC unroll 2
  for (int64_t i = 0; i < k; ++i, x += Rows) {
    __m512 v[Panels];
#pragma GCC unroll 4
    for (int p = 0; p < Panels; ++p) {
      v[p] = _mm512_loadu_ps(panel[p]);
      ahead.own(panel[p], kPanel * sizeof(float));
      panel[p] += kPanel;
    }
    ahead.next_step();
#pragma GCC unroll 12
    for (int r = 0; r < Rows; ++r) {
      const __m512 a = _mm512_set1_ps(x[r]);
#pragma GCC unroll 4
      for (int p = 0; p < Panels; ++p) c[r][p] = _mm512_fmadd_ps(a, v[p], c[r][p]);
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < Panels; ++p) {
    const int64_t outputs = p == Panels - 1 ? valid : kPanel;
    const PanelBias biases = panel_bias(bias == nullptr ? nullptr : bias + p * kPanel, outputs);
    for (int r = 0; r < Rows; ++r)
      store_outputs(_mm512_castps512_ps256(c[r][p]), _mm512_extractf32x8_ps(c[r][p], 1), biases,
                    y + r * ldy + p * kPanel, outputs);
  }
}

using FewRowsTile = void (*)(const float*, const float*, int64_t, const float*, float*, int64_t,
                             int64_t, PassPrefetch);

template <int Panels, int... Rows>
constexpr std::array<FewRowsTile, sizeof...(Rows)> few_rows_tiles(
    std::integer_sequence<int, Rows...>) {
  return {&few_rows_tile<Rows + 1, Panels>...};
}

// kFewRowsTiles[panels - 1][rows - 1].
constexpr std::array<std::array<FewRowsTile, kFewRowsMax>, kFewMaxPanels> kFewRowsTiles = {
    few_rows_tiles<1>(std::make_integer_sequence<int, kFewRowsMax>{}),
    few_rows_tiles<2>(std::make_integer_sequence<int, kFewRowsMax>{}),
    few_rows_tiles<3>(std::make_integer_sequence<int, kFewRowsMax>{}),
    few_rows_tiles<4>(std::make_integer_sequence<int, kFewRowsMax>{})};

// x's m rows (row stride k) k-major at xp ([k, m]), then all of them over every group of panels
// in one pass over W.
void few_rows_product(const float* xs, int64_t m, int64_t k, const float* w, int64_t panels,
                      const float* bias, float* y, int64_t n, float* xp) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) xp[i * m + r] = xs[r * k + i];
  const int64_t group = few_row_tile_panels(m);
  const int64_t steps = (panels + group - 1) / group;
#pragma omp for schedule(static)
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t p = step * group, count = std::min(group, panels - p);
    const int64_t valid = std::min(kPanel, n - (p + count - 1) * kPanel);
    // The panels stream as in a pass's first tile call (prefetch.h).
    kFewRowsTiles[count - 1][m - 1](xp, w + p * k * kPanel, k,
                                    bias == nullptr ? nullptr : bias + p * kPanel,
                                    y + p * kPanel, n, valid, PassPrefetch(true, nullptr, 0, k));
  }
}

// Rows [0, rows) of x (row stride k) into chunks of 6 rows, k-major; rows past the end are 0.
void pack_rows(const float* x, int64_t rows, int64_t k, float* out) {
  for (int64_t r = 0; r < kChunk; ++r)
    if (r < rows)
      for (int64_t i = 0; i < k; ++i) out[i * kChunk + r] = x[r * k + i];
    else
      for (int64_t i = 0; i < k; ++i) out[i * kChunk + r] = 0.0f;
}

}  // namespace

bool few_row_tiles_allowed() { return switch_on("TOKENMILL_FEW_ROW_TILES"); }

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_weight: weight must be float32 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // Zero rows pad the last panel to 16 outputs, so the tile never branches on N.
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

void check_packed_linear_weight(const char* op, const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              op, ": packed must come from pack_linear_weight");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, op, ": x and weight disagree on K");
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, op,
              ": n does not match the packed weight");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0, op,
              ": packed weight must be 32-byte aligned");
}

int64_t packed_linear_scratch_bytes(int64_t m, int64_t k) {
  if (few_rows_run(m)) return m * k * static_cast<int64_t>(sizeof(float));
  return m <= kNarrowMaxRows ? 0 : (m + kChunk - 1) / kChunk * k * kChunk * sizeof(float);
}

void packed_linear_team(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                        const at::Tensor& y, void* scratch) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1), panels = packed.size(0);
  const float* xs = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* out = y.data_ptr<float>();
  if (few_rows_run(m)) {
    few_rows_product(xs, m, k, w, panels, bias, out, n, static_cast<float*>(scratch));
    return;
  }
  if (m <= kNarrowMaxRows) {
    const auto product =
        m == 1 ? narrow_product<1> : m == 2 ? narrow_product<2> : narrow_product<3>;
    product(xs, k, w, panels, bias, out, n);
    return;
  }
  const int64_t chunks = (m + kChunk - 1) / kChunk;
  auto* xp = static_cast<float*>(scratch);  // [chunks, k, 6]
  constexpr int64_t kChunksPerPass = kRowsPerPass / kChunk;
#pragma omp for schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    pack_rows(xs + c * kChunk * k, std::min(kChunk, m - c * kChunk), k, xp + c * k * kChunk);
  const int64_t steps = (panels + kTilePanels - 1) / kTilePanels;
  // Chunks of x per tile call: two where the zmm tile runs, which has the registers for them.
  const int64_t chunks_per_call = kTilePanels;
  for (int64_t first = 0; first < chunks; first += kChunksPerPass) {
    const int64_t last = std::min(chunks, first + kChunksPerPass);
    const int64_t calls = (last - first + chunks_per_call - 1) / chunks_per_call;
#pragma omp for schedule(static)
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t p = step * kTilePanels;
      const bool pair = kTilePanels == 2 && p + 1 < panels;
      const int64_t last_panel = pair ? p + 1 : p;
      const int64_t valid = std::min(kPanel, n - last_panel * kPanel);
      const float* panel = w + p * k * kPanel;
      const float* biases = bias ? bias + p * kPanel : nullptr;
      // The next step's panels (a panel is one 64-byte line per step of k), shared out among
      // the calls when there are several (prefetch.h).
      const int64_t next_lines =
          calls > 1 ? std::clamp<int64_t>(panels - p - kTilePanels, 0, kTilePanels) * k : 0;
      for (int64_t call = 0; call < calls; ++call) {
        const int64_t c = first + call * chunks_per_call;
        const PassPrefetch ahead =
            PassPrefetch::share(call, calls, panel + kTilePanels * k * kPanel, next_lines, k);
        const float* xc = xp + c * k * kChunk;
        float* yc = out + c * kChunk * n + p * kPanel;
        const int64_t rows = std::min(kChunk, m - c * kChunk);
        if (pair && c + 1 < last)
          tile_pair<2>({xc, xc + k * kChunk}, {rows, std::min(kChunk, m - (c + 1) * kChunk)},
                       panel, panel + k * kPanel, k, biases, yc, n, valid, ahead);
        else if (pair)
          tile_pair<1>({xc}, {rows}, panel, panel + k * kPanel, k, biases, yc, n, valid, ahead);
        else  // one panel: the AVX2 tile, or the zmm tile's odd last panel, chunk by chunk
          for (int64_t h = c; h < std::min(last, c + chunks_per_call); ++h)
            tile(xp + h * k * kChunk, panel, k, biases, out + h * kChunk * n + p * kPanel, n,
                 std::min(kChunk, m - h * kChunk), valid, h == c ? ahead : PassPrefetch{});
      }
    }
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "packed_linear: x must be float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  check_packed_linear_weight("packed_linear", packed, n, k);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "packed_linear: bias must be a contiguous float32 [N]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  at::Tensor scratch = at::empty({packed_linear_scratch_bytes(m, k)}, x.options().dtype(at::kByte));
#pragma omp parallel
  packed_linear_team(xc, packed, bias.has_value() ? bias->data_ptr<float>() : nullptr, y,
                     scratch.data_ptr());
  return y;
}

}  // namespace tokenmill
