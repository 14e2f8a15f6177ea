// Causal attention over a prompt's new tokens (all of it, or one chunk after cached context) on
// float32 FMAs, flash-style, for a float32 or a bfloat16 model on any CPU the kernels run on:
// the path prefill_attention takes where AMX tiles do not (prefill_attention.cpp).
//
// torch's scaled_dot_product_attention spends most of a short prompt's call setting up, runs
// well below the FMAs' rate on small heads (SmolLM2's 64 dims) and computes a sliding window in
// full before masking it. Here scores, weights and sums of one 32-key step at a time stay in
// L1, with an online softmax, so no [n, S] matrix is ever made; bfloat16 keys and values are
// widened to float once per call, and a bfloat16 output is rounded once. The body
// (prefill_attention_fma.inc) is compiled twice, for AVX2's 8 lanes and AVX-512's 16; the
// library picks one as it loads (TOKENMILL_AVX512=0 keeps AVX2).

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <memory>

#include "kernels.h"
#include "simd.h"

namespace tokenmill {
namespace {

constexpr int64_t kMaxHeadDim = 256;
// Below this many multiply-adds a call runs on the calling thread alone (team.h's rule for
// the other kernels, counted in the work this kernel does).
constexpr int64_t kParallelMinMacs = int64_t{1} << 20;

// The call's tensors and shapes. Query and output rows are the last n of the S context
// positions; strides count elements between positions, and a position's heads lie side by side.
template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  int64_t q_stride, k_stride, v_stride, out_stride;
  int64_t n, s, s_pad, kv_heads, group, dim, window;  // window 0: none
  float scale;
};

namespace avx2 {

using Vec = __m256;
using IVec = __m256i;
constexpr int64_t kLanes = 8;
constexpr int kKeyRun = 8;  // eight score sums, the query and a broadcast fit AVX2's 16 registers
constexpr int kDimRun = 8;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vexp(Vec x) { return exp8(x); }
inline Vec reciprocal(Vec x) { return _mm256_div_ps(_mm256_set1_ps(1.0f), x); }
inline IVec lane_positions(int64_t first) {
  return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)),
                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// -inf where the lane's position comes before `key`, or (window > 0) at least `window` after it.
inline Vec hide(Vec s, IVec positions, int64_t key, int64_t window) {
  __m256i visible = _mm256_cmpgt_epi32(positions, _mm256_set1_epi32(static_cast<int>(key - 1)));
  if (window > 0)
    visible = _mm256_and_si256(
        visible,
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(key + window)), positions));
  return _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), s,
                          _mm256_castsi256_ps(visible));
}
inline Vec finite_or_zero(Vec x) {
  const Vec minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  return _mm256_blendv_ps(x, _mm256_setzero_ps(), _mm256_cmp_ps(x, minus_inf, _CMP_EQ_OQ));
}
inline bool differs_from_one(Vec x) {
  return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(1.0f), _CMP_NEQ_UQ)) != 0;
}
// Lanes i of base[index[i]].
inline Vec gather(const float* base, IVec index) { return _mm256_i32gather_ps(base, index, 4); }
inline IVec lane_offsets(int64_t stride) {
  return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                            _mm256_set1_epi32(static_cast<int>(stride)));
}
template <typename T>
using Row = Lanes<T>;

#include "prefill_attention_fma.inc"

}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl")
namespace avx512 {

using Vec = __m512;
using IVec = __m512i;
constexpr int64_t kLanes = 16;
constexpr int kKeyRun = 16;  // sixteen score sums and the query of 32 registers
constexpr int kDimRun = 16;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vexp(Vec x) { return exp16(x); }
inline Vec reciprocal(Vec x) { return _mm512_div_ps(_mm512_set1_ps(1.0f), x); }
inline IVec lane_positions(int64_t first) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline Vec hide(Vec s, IVec positions, int64_t key, int64_t window) {
  __mmask16 visible = _mm512_cmp_epi32_mask(positions, _mm512_set1_epi32(static_cast<int>(key)),
                                            _MM_CMPINT_NLT);
  if (window > 0)
    visible &= _mm512_cmp_epi32_mask(positions,
                                     _mm512_set1_epi32(static_cast<int>(key + window)),
                                     _MM_CMPINT_LT);
  return _mm512_mask_blend_ps(visible, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                              s);
}
inline Vec finite_or_zero(Vec x) {
  const Vec minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, minus_inf, _CMP_EQ_OQ), x,
                              _mm512_setzero_ps());
}
inline bool differs_from_one(Vec x) {
  return _mm512_cmp_ps_mask(x, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
}
inline Vec gather(const float* base, IVec index) { return _mm512_i32gather_ps(index, base, 4); }
inline IVec lane_offsets(int64_t stride) {
  return _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(stride)));
}
template <typename T>
using Row = Lanes16<T>;

#include "prefill_attention_fma.inc"

}  // namespace avx512
#pragma GCC pop_options

// Whether the kernel takes its 16-lane path (TOKENMILL_AVX512=0 keeps the 8-lane one).
const bool kWidePrefill = avx512_usable();

void check_rows(const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == dtype, "prefill_attention: ", name,
              " must be [positions, heads, head_dim] of q's dtype");
  TORCH_CHECK(t.size(2) == dim && t.stride(2) == 1 && t.stride(1) == dim, "prefill_attention: ",
              name, "'s heads must be contiguous, each of q's head_dim");
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
         int64_t window, const at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t s = k.size(0), kv_heads = k.size(1);
  const int64_t s_pad = (s + avx512::kKeys - 1) / avx512::kKeys * avx512::kKeys;
  static_assert(avx2::kKeys == avx512::kKeys, "one padding serves both paths");
  // Widened K panels and V rows, [kv_heads, s_pad, dim] each.
  at::Tensor widened = at::empty({2, kv_heads, s_pad, dim}, q.options().dtype(at::kFloat));
  float* panels = widened.data_ptr<float>();
  float* rows = panels + kv_heads * s_pad * dim;
  const Problem<T> p{static_cast<const T*>(q.data_ptr()),
                     static_cast<const T*>(k.data_ptr()),
                     static_cast<const T*>(v.data_ptr()),
                     static_cast<T*>(out.data_ptr()),
                     q.stride(0),
                     k.stride(0),
                     v.stride(0),
                     heads * dim,
                     n,
                     s,
                     s_pad,
                     kv_heads,
                     heads / kv_heads,
                     dim,
                     window,
                     scale};
  if (kWidePrefill)
    avx512::attend(p, panels, rows);
  else
    avx2::attend(p, panels, rows);
}

}  // namespace

at::Tensor prefill_attention_fma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "prefill_attention: q must be [positions, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "prefill_attention: q must be float32 or bfloat16");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(dim >= 1 && dim <= kMaxHeadDim, "prefill_attention: head_dim must be at most 256");
  check_rows("q", q, q.scalar_type(), dim);
  check_rows("k", k, q.scalar_type(), dim);
  check_rows("v", v, q.scalar_type(), dim);
  TORCH_CHECK(v.sizes() == k.sizes(), "prefill_attention: k and v must have one shape");
  const int64_t s = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0,
              "prefill_attention: q's heads must be a multiple of k's");
  TORCH_CHECK(n >= 1 && s >= n, "prefill_attention: q's positions must be the last of k's");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0 (0: none)");
  at::Tensor out = at::empty({n, heads, dim}, q.options());
  if (q.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(q, k, v, static_cast<float>(scale), window, out);
  else
    run<float>(q, k, v, static_cast<float>(scale), window, out);
  return out;
}

}  // namespace tokenmill
