// The kernels' work loops, written to run inside a parallel region that the caller opened.
//
// Each function here shares out its work with orphaned `#pragma omp for` loops: called inside a
// parallel region, a loop's items are split among that region's threads and the loop ends in
// the region's barrier; called outside one, the calling thread does them all. The at::Tensor
// entry points (kernels.h) check their arguments, allocate their outputs and open a region around
// one such call. The decode loop (decode_loop.cpp) checks and allocates once per step, opens one
// region and makes every call of every layer inside it, so the second thread is not released and
// woken again around each of a layer's dozen kernels, nor left waiting while the first thread
// allocates, checks and dispatches between them.
//
// Nothing here checks an argument or allocates a tensor: an exception cannot leave a parallel
// region, and each thread of it would make its own tensor. Every thread must make the same calls
// in the same order. Tensors are only read for their sizes, strides and data.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace tokenmill {

// Below this many elements of work an entry point runs its team function on the calling thread
// alone, without opening a region: a few microseconds of work (decode's handful of rows, one
// row of logits) is less than waking the OpenMP team costs.
constexpr int64_t kParallelMinElements = 1 << 16;

// The checks paged_decode_attention_team needs first, on q [B, H, d] and a cache [2, blocks,
// block_size, kv_heads, d]: returns the tables and lengths as contiguous int64, every block id
// and length read inside the cache.
std::pair<at::Tensor, at::Tensor> check_decode_attention(const char* op, const at::Tensor& q,
                                                         const at::Tensor& cache,
                                                         const at::Tensor& block_tables,
                                                         const at::Tensor& seq_lens);

// The checks the linear entry points make on a weight's tensors, for callers that check a weight
// once and then run many products with it: each throws unless the tensors hold n outputs of k
// inputs in the layout of their kernel.
void check_packed_linear_weight(const char* op, const at::Tensor& packed, int64_t n, int64_t k);
void check_bfloat16_linear_weight(const char* op, const at::Tensor& packed, int64_t n,
                                  int64_t k);
void check_int8_panels(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t k, int64_t group_size);
void check_int4_panels(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t n, int64_t k, int64_t group_size);
void check_nf4_weight(const char* op, const at::Tensor& codes, const at::Tensor& qabsmax,
                      const at::Tensor& second, int64_t n, int64_t k, int64_t group_size);

// out [rows, d] = RMSNorm of x's rows of d values, x being [rows, d] or [T, heads, d] with each
// row contiguous and any token stride (q or k heads in the merged qkv output). With a residual
// [rows, d] (contiguous), residual += x first, and the norm is taken of the sum. x, the
// residual, the weight and out are all float32 or all bfloat16.
void add_rms_norm_team(const at::Tensor& x, void* residual, const at::Tensor& weight, float eps,
                       const at::Tensor& out);

// q [T, H, d] and k [T, KVH, d] rotated in place; positions int64 [T] inside the tables.
void rotary_embedding_team(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& cos, const at::Tensor& sin);

// k and v [T, KVH, d] (float32 or bfloat16) into their slots (int64 [T]) of a cache of their own
// dtype, or of an int8 / fp8 one when `scales` is given.
void store_kv_team(const at::Tensor& kv_cache, const at::Tensor* scales, const at::Tensor& slots,
                   const at::Tensor& k, const at::Tensor& v);

// out [B, H * d] (contiguous) = each sequence's query q [B, H, d] (heads contiguous, any token
// stride) attending to its cached tokens; tables and lens int64 and contiguous. q and out are
// float32, or bfloat16 over a bfloat16 or 8-bit cache. `scratch`: decode_attention_scratch_bytes
// (B, H, d, the cache's block size, the tables' columns) bytes, for a long context's partitions.
int64_t decode_attention_scratch_bytes(int64_t batch, int64_t heads, int64_t dim,
                                       int64_t block_size, int64_t max_blocks);
// `key_mask` (check_key_mask's, or nullptr): bool [B, width], row b hiding the keys of
// [lens[b] - width, lens[b]) whose flag is clear (a draft tree's other branches); a sliding
// window then spans the last `window` keys the row leaves visible.
void paged_decode_attention_team(const at::Tensor& q, const at::Tensor& kv_cache,
                                 const at::Tensor* scales, const at::Tensor& tables,
                                 const at::Tensor& lens, double scale, int64_t window,
                                 const at::Tensor& out, void* scratch,
                                 const at::Tensor* key_mask = nullptr);
// A key mask's checks (bool [B, width], each row showing its own last key); returns it
// contiguous.
at::Tensor check_key_mask(const char* op, const at::Tensor& key_mask, const at::Tensor& lens);

// The gated MLP's activation: SwiGLU (Llama) or tanh-GELU (Gemma).
enum class GatedActivation { kSilu, kGeluTanh };

// out [R, F] = act(x[:, :F]) * x[:, F:], both contiguous, both float32 or both bfloat16.
void gated_activation_team(GatedActivation activation, const at::Tensor& x,
                           const at::Tensor& out);

// y [M, N] = x [M, K] W^T + bias (nullptr: none), x and y contiguous; the skinny kernel's weight
// is float32 or bfloat16. The packed and quantized products also need `scratch`,
// *_scratch_bytes(M, K) bytes of it, for x in their own layout.
void skinny_linear_team(const at::Tensor& x, const at::Tensor& weight, const float* bias,
                        const at::Tensor& y);
void fp8_linear_team(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const float* bias, const at::Tensor& y);
int64_t packed_linear_scratch_bytes(int64_t m, int64_t k);
void packed_linear_team(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                        const at::Tensor& y, void* scratch);
// A bfloat16 product on its packed weight, on the path bfloat16_linear.cpp chose (AMX tiles,
// AVX512-BF16 dot products, or float32 FMAs over widened weights): x and y bfloat16, x's rows
// contiguous, the bias (nullptr: none) float32.
int64_t bfloat16_linear_scratch_bytes(int64_t m, int64_t k);
void bfloat16_linear_team(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                          const at::Tensor& y, void* scratch);
int64_t int8_linear_scratch_bytes(int64_t m, int64_t k);
int64_t int4_linear_scratch_bytes(int64_t m, int64_t k);
void int8_linear_team(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                      int64_t group_size, const float* bias, const at::Tensor& y, void* scratch);
void int4_linear_team(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                      const at::Tensor& mins, int64_t group_size, const float* bias,
                      const at::Tensor& y, void* scratch);

void nf4_linear_team(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& qabsmax,
                     const at::Tensor& second, int64_t group_size, const float* bias,
                     const at::Tensor& y);

}  // namespace tokenmill
