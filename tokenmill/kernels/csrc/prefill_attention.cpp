// Causal attention over a prompt's new tokens (all of it, or one chunk after cached context) for
// a bfloat16 model, on AMX tiles, flash-style: scores, weights and sums of one 32-key block at a
// time, so no [n, S] matrix is ever made. Where the tiles do not run (no AMX, float32, a head
// dim not a multiple of 32), the entry point hands the call to the FMA kernel
// (prefill_attention_fma.cpp).
//
// torch's scaled_dot_product_attention runs well below the tiles' rate on SmolLM2's heads over
// long prompts, and far lower over the short prompts of a batch, where most of a call is set-up;
// a sliding window it computes in full and then masks.
//
// The work is laid out transposed. A work item is 16 positions of one query head. Scores come
// as S^T = K Q^T: keys are the tile rows, so K's rows load straight from the cache or the qkv
// output, and only the item's 16 query rows are rearranged (into the pairs of head dims AMX's
// B operand wants). In S^T every softmax statistic (each position's running maximum and sum)
// is a column, so the online softmax is vertical SIMD over 16 positions at once, with no
// horizontal reductions. The weights P^T, rounded to bfloat16 as torch's kernel rounds them
// before its product with V, go straight into the B operand of O^T += V^T P^T, two key rows
// interleaved per tile row; V^T is the one transpose, made once per call and KV head and read
// by every query head of its group. Positions are transposed back only when written out.

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include "amx_tiles.h"
#include "kernels.h"
#include "simd.h"

namespace tokenmill {
namespace {

constexpr int64_t kKeys = 32;       // keys per softmax step: one tile row of P^T's key pairs
constexpr int64_t kDepth = 32;      // head dims per tile row of K (64 bytes of bfloat16)
constexpr int64_t kPositions = 16;  // query positions per work item: a tile's 16 columns
constexpr int64_t kMaxHeadDim = 256;

// The call's tensors and shapes. Query and output rows are the last n of the S context
// positions; strides count elements between positions, and a position's heads lie side by side.
struct Problem {
  const uint16_t* q;
  uint16_t* out;
  const uint16_t* keys;  // K: [kv_heads, s_pad, dim], zeros past S
  const uint16_t* vt;    // V^T: [kv_heads, dim, s_pad], zeros past S
  int64_t q_stride, out_stride, s_pad;
  int64_t n, s, group, dim, window;  // window 0: none
  float scale;
};

// One thread's buffers, reused for every item it takes.
struct alignas(64) Scratch {
  uint16_t query_t[kMaxHeadDim * kPositions];  // Q^T as B tiles: [dim / 32][16 pairs][16][2]
  float scores[kKeys * kPositions];            // S^T [32 keys][16 positions]
  uint16_t weights_t[kKeys * kPositions];      // P^T as a B tile: [16 key pairs][16][2]
  float acc[kMaxHeadDim * kPositions];         // O^T [dim][16 positions], before the division
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

// Rows become columns: word i of r[j] moves to word j of r[i]. The query's pairs, V^T and the
// output are the three rearrangements a call makes; done a word at a time, they took a third of
// a short prompt's call.
void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// Sixteen 32-bit words of `row`, or zeros where there is no row.
__m512i words16(const uint16_t* row) {
  return row != nullptr ? _mm512_loadu_si512(row) : _mm512_setzero_si512();
}

// One KV head's keys [k0, k0 + 32) copied into K, contiguous, and transposed into V^T, zeros
// past S in both: the tiles then read whole rows and never past the end, and zero weights times
// leftover bits could still make NaN. V^T goes 32 head dims at a time: each half of the keys'
// pairs of dims transposed, then the pairs' first and second halves gathered into two rows.
void lay_out_block(const uint16_t* k, const uint16_t* v, int64_t k_stride, int64_t v_stride,
                   int64_t s, int64_t dim, int64_t k0, uint16_t* keys, uint16_t* vt,
                   int64_t s_pad) {
  for (int64_t j = 0; j < kKeys; ++j) {
    uint16_t* row = keys + (k0 + j) * dim;
    if (k0 + j < s)
      std::memcpy(row, k + (k0 + j) * k_stride, dim * sizeof(uint16_t));
    else
      std::memset(row, 0, dim * sizeof(uint16_t));
  }
  alignas(64) static constexpr uint16_t kFirst[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                                      22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                                      44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  const __m512i first = _mm512_load_si512(kFirst);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(1));
  for (int64_t c = 0; c < dim; c += 32) {
    __m512i halves[2][16];
    for (int h = 0; h < 2; ++h) {
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = k0 + 16 * h + j;
        halves[h][j] = words16(key < s ? v + key * v_stride + c : nullptr);
      }
      transpose16(halves[h]);
    }
    for (int64_t i = 0; i < 16; ++i) {
      uint16_t* row = vt + (c + 2 * i) * s_pad + k0;
      _mm512_storeu_si512(row, _mm512_permutex2var_epi16(halves[0][i], first, halves[1][i]));
      _mm512_storeu_si512(row + s_pad,
                          _mm512_permutex2var_epi16(halves[0][i], second, halves[1][i]));
    }
  }
}

// 2^t for t <= 0 in 16 lanes: t = n + f with |f| <= 1/2, 2^f by its Taylor series to f^6
// (relative error about 1e-7, as exp8's), scaled by 2^n in one VSCALEFPS. Below -126 the result
// is 0, never a denormal, and 2^-inf is 0: masked-out scores weigh nothing.
__m512 exp2_nonpositive(__m512 t) {
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393e-4f);  // ln2^6 / 6!, then down to ln2^0 / 0!
  for (const float c : {1.3333558146e-3f, 9.6181291076e-3f, 5.5504108665e-2f, 2.4022650696e-1f,
                        6.9314718056e-1f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// Q^T of the item's positions as one B tile per 32 head dims: tile row i holds dims 2i and
// 2i + 1 of each position. Positions past the last are zeros.
void load_query(const Problem& p, int64_t head, int64_t first, int64_t rows, Scratch& w) {
  for (int64_t c = 0; c < p.dim; c += 32) {
    __m512i pairs[16];
    for (int64_t r = 0; r < kPositions; ++r)
      pairs[r] = words16(r < rows ? p.q + (first + r) * p.q_stride + head * p.dim + c : nullptr);
    transpose16(pairs);
    for (int64_t i = 0; i < 16; ++i)
      _mm512_store_si512(w.query_t + (c + 2 * i) * kPositions, pairs[i]);
  }
}

// S^T for keys [k0, k0 + 32) into w.scores: tmm0 and tmm1 the two 16-key halves' scores, tmm2
// and tmm4 their key rows, tmm3 Q^T.
void score_block(const Problem& p, const uint16_t* keys, int64_t k0, Scratch& w) {
  const uint16_t* rows = keys + k0 * p.dim;
  const int64_t stride = p.dim * 2;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < p.dim; c += kDepth) {
    _tile_loadd(3, w.query_t + c * kPositions, kTileRowBytes);
    _tile_loadd(2, rows + c, stride);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(4, rows + kTileRows * p.dim + c, stride);
    _tile_dpbf16ps(1, 4, 3);
  }
  _tile_stored(0, w.scores, kTileRowBytes);
  _tile_stored(1, w.scores + kTileRows * kPositions, kTileRowBytes);
}

// O^T += V^T P^T for keys [k0, k0 + 32): P^T in tmm7, V^T's rows in tmm4 and tmm5, O^T's sums
// 32 head dims at a time in tmm0 and tmm1, then tmm2 and tmm3, so that one pair's loads overlap
// the other's products. GCC's tile intrinsics take only literal register numbers, hence a macro.
void add_values(const Problem& p, int64_t kv_head, int64_t k0, Scratch& w) {
  _tile_loadd(7, w.weights_t, kTileRowBytes);
  const uint16_t* vt = p.vt + kv_head * p.dim * p.s_pad + k0;
  const int64_t vt_stride = p.s_pad * 2, half = kTileRows * kPositions;
#define TOKENMILL_ADD_VALUE_PAIR(sum0, sum1, d)                  \
  {                                                             \
    float* acc = w.acc + (d) * kPositions;                      \
    _tile_loadd(sum0, acc, kTileRowBytes);                      \
    _tile_loadd(sum1, acc + half, kTileRowBytes);               \
    _tile_loadd(4, vt + (d) * p.s_pad, vt_stride);              \
    _tile_dpbf16ps(sum0, 4, 7);                                 \
    _tile_loadd(5, vt + ((d) + kTileRows) * p.s_pad, vt_stride); \
    _tile_dpbf16ps(sum1, 5, 7);                                 \
    _tile_stored(sum0, acc, kTileRowBytes);                     \
    _tile_stored(sum1, acc + half, kTileRowBytes);              \
  }
  for (int64_t d = 0; d < p.dim; d += 4 * kTileRows) {
    TOKENMILL_ADD_VALUE_PAIR(0, 1, d)
    if (d + 2 * kTileRows < p.dim) TOKENMILL_ADD_VALUE_PAIR(2, 3, d + 2 * kTileRows)
  }
#undef TOKENMILL_ADD_VALUE_PAIR
}

// Positions [first, first + 16) of one query head (fewer at the end) over every key they see.
void attend_positions(const Problem& p, int64_t head, int64_t first, Scratch& w) {
  const int64_t rows = std::min(kPositions, p.n - first);
  const int64_t kv_head = head / p.group;
  const int64_t first_pos = p.s - p.n + first, last_pos = first_pos + rows - 1;
  const int64_t lowest_key = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  load_query(p, head, first, rows, w);
  std::fill(w.acc, w.acc + p.dim * kPositions, 0.0f);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 zero = _mm512_setzero_ps();
  // Weights are e^(scale (s - max)) = 2^(s log2(e) scale - max log2(e) scale): one FMA a score.
  const __m512 log2e_scale = _mm512_set1_ps(p.scale * 1.44269504088896341f);
  const __m512i positions = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int>(first_pos)),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  // Word i of a weight pair row: position i / 2's weight for the even key, then the odd one.
  const __m512i interleave = _mm512_setr_epi32(
      0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005, 0x00160006,
      0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b, 0x001c000c, 0x001d000d,
      0x001e000e, 0x001f000f);
  __m512 running_max = minus_inf, running_sum = zero;
  for (int64_t k0 = lowest_key / kKeys * kKeys; k0 <= last_pos; k0 += kKeys) {
    score_block(p, p.keys + kv_head * p.s_pad * p.dim, k0, w);
    // Every key of the block visible to every position: no mask to apply.
    const bool all_visible = k0 + kKeys - 1 <= first_pos && k0 + kKeys <= p.s &&
                             (p.window == 0 || k0 > last_pos - p.window);
    // Four running maxima (and below two sums) instead of one: a single chain of dependent
    // VMAXPS or VADDPS would wait out each one's latency.
    __m512 maxima[4] = {minus_inf, minus_inf, minus_inf, minus_inf};
    for (int64_t j = 0; j < kKeys; ++j) {
      __m512 s = _mm512_load_ps(w.scores + j * kPositions);
      if (!all_visible) {
        const int key = static_cast<int>(k0 + j);
        __mmask16 visible =
            k0 + j < p.s ? _mm512_cmp_epi32_mask(positions, _mm512_set1_epi32(key), _MM_CMPINT_NLT)
                         : 0;
        if (p.window > 0)
          visible &= _mm512_cmp_epi32_mask(
              positions, _mm512_set1_epi32(key + static_cast<int>(p.window)), _MM_CMPINT_LT);
        s = _mm512_mask_blend_ps(visible, minus_inf, s);
        _mm512_store_ps(w.scores + j * kPositions, s);
      }
      maxima[j % 4] = _mm512_max_ps(maxima[j % 4], s);
    }
    const __m512 new_max = _mm512_max_ps(
        _mm512_max_ps(running_max, _mm512_max_ps(maxima[0], maxima[1])),
        _mm512_max_ps(maxima[2], maxima[3]));
    // A position that sees no key yet keeps a maximum of -inf; 0 stands in for it so that its
    // weights come out 2^-inf = 0, not NaN.
    const __m512 shift = _mm512_mul_ps(
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(new_max, minus_inf, _CMP_EQ_OQ), new_max, zero),
        log2e_scale);
    // Exactly 1 where the maximum stayed: both products round alike.
    const __m512 correction =
        exp2_nonpositive(_mm512_sub_ps(_mm512_mul_ps(running_max, log2e_scale), shift));
    __m512 even_sum = zero, odd_sum = zero;
    for (int64_t j = 0; j < kKeys; j += 2) {
      const __m512 even = exp2_nonpositive(
          _mm512_fmsub_ps(_mm512_load_ps(w.scores + j * kPositions), log2e_scale, shift));
      const __m512 odd = exp2_nonpositive(
          _mm512_fmsub_ps(_mm512_load_ps(w.scores + (j + 1) * kPositions), log2e_scale, shift));
      even_sum = _mm512_add_ps(even_sum, even);
      odd_sum = _mm512_add_ps(odd_sum, odd);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // even keys' in words 0-15
      _mm512_store_si512(w.weights_t + j * kPositions,
                         _mm512_permutexvar_epi16(interleave, both));
    }
    running_sum = _mm512_fmadd_ps(running_sum, correction, _mm512_add_ps(even_sum, odd_sum));
    running_max = new_max;
    if (_mm512_cmp_ps_mask(correction, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0)
      for (int64_t d = 0; d < p.dim; ++d)
        _mm512_store_ps(w.acc + d * kPositions,
                        _mm512_mul_ps(_mm512_load_ps(w.acc + d * kPositions), correction));
    add_values(p, kv_head, k0, w);
  }
  const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), running_sum);
  for (int64_t c = 0; c < p.dim; c += 16) {
    __m512i outputs[16];
    for (int64_t i = 0; i < 16; ++i)
      outputs[i] = _mm512_castps_si512(
          _mm512_mul_ps(_mm512_load_ps(w.acc + (c + i) * kPositions), inverse));
    transpose16(outputs);  // now a position's 16 head dims each
    for (int64_t r = 0; r < rows; ++r)
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(p.out + (first + r) * p.out_stride + head * p.dim + c),
          (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(outputs[r])));
  }
}

#pragma GCC pop_options

void check_rows(const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kBFloat16, "prefill_attention: ", name,
              " must be bfloat16 [positions, heads, head_dim]");
  TORCH_CHECK(t.size(2) == dim && t.stride(2) == 1 && t.stride(1) == dim, "prefill_attention: ",
              name, "'s heads must be contiguous, each of q's head_dim");
}

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "prefill_attention: q must be [positions, heads, head_dim]");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  // The tiles take a bfloat16 model's heads of whole 32-dim tile rows; FMAs take the rest.
  if (!(amx_available() && q.scalar_type() == at::kBFloat16 && dim % kDepth == 0 &&
        dim <= kMaxHeadDim))
    return prefill_attention_fma(q, k, v, scale, window);
  check_rows("q", q, dim);
  check_rows("k", k, dim);
  check_rows("v", v, dim);
  const int64_t s = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes(), "prefill_attention: k and v must have one shape");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0,
              "prefill_attention: q's heads must be a multiple of k's");
  TORCH_CHECK(n >= 1 && s >= n, "prefill_attention: q's positions must be the last of k's");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0 (0: none)");
  at::Tensor out = at::empty({n, heads, dim}, q.options());
  const int64_t s_pad = (s + kKeys - 1) / kKeys * kKeys;
  at::Tensor keys = at::empty({kv_heads, s_pad, dim}, q.options());
  at::Tensor vt = at::empty({kv_heads, dim, s_pad}, q.options());
  const Problem p{static_cast<const uint16_t*>(q.data_ptr()),
                  static_cast<uint16_t*>(out.data_ptr()),
                  static_cast<const uint16_t*>(keys.data_ptr()),
                  static_cast<const uint16_t*>(vt.data_ptr()),
                  q.stride(0),
                  heads * dim,
                  s_pad,
                  n,
                  s,
                  heads / kv_heads,
                  dim,
                  window,
                  static_cast<float>(scale)};
  const auto* k_ptr = static_cast<const uint16_t*>(k.data_ptr());
  const auto* v_ptr = static_cast<const uint16_t*>(v.data_ptr());
  auto* keys_ptr = static_cast<uint16_t*>(keys.data_ptr());
  auto* vt_ptr = static_cast<uint16_t*>(vt.data_ptr());
  const int64_t key_blocks = s_pad / kKeys, tiles = (n + kPositions - 1) / kPositions;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < kv_heads * key_blocks; ++item) {
      const int64_t h = item / key_blocks, k0 = item % key_blocks * kKeys;
      lay_out_block(k_ptr + h * dim, v_ptr + h * dim, k.stride(0), v.stride(0), s, dim, k0,
                    keys_ptr + h * s_pad * dim, vt_ptr + h * dim * s_pad, s_pad);
    }
    configure_tiles();
    const auto scratch = std::make_unique<Scratch>();
    // One KV head's items after another, so that its keys and values stay in cache; within
    // one, the later positions first: they see more keys, and the short items left at the end
    // even out the threads.
    const int64_t group = heads / kv_heads;
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < heads * tiles; ++item) {
      const int64_t kv_head = item / (tiles * group), rest = item % (tiles * group);
      const int64_t tile = tiles - 1 - rest / group;
      attend_positions(p, kv_head * group + rest % group, tile * kPositions, *scratch);
    }
    release_tiles();
  }
  return out;
}

}  // namespace tokenmill
