// The native kernels' entry points: bindings.cpp exposes them to Python, and decode_loop.cpp
// calls them directly, layer after layer, without a trip through Python.

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace tokenmill {
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias);
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias);
// Whether products of a few rows of x may take the few-rows tiles on AVX-512 (packed_linear.cpp,
// bfloat16_widen.inc): TOKENMILL_FEW_ROW_TILES=0 leaves them out, the baseline they are measured
// against (outputs are the same).
bool few_row_tiles_allowed();
// The few-rows tiles' shapes, one register budget for both: a tile of up to kFewRowTileRows rows
// by few_row_tile_panels(rows) panels keeps at most 27 zmm sums, which with the panels' weight
// vectors fit in the 32 zmm registers.
constexpr int64_t kFewRowTileRows = 9;
constexpr int64_t few_row_tile_panels(int64_t rows) { return rows <= 6 ? 4 : 3; }
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& bias);
bool amx_available();
// Which path this process's bfloat16 products take: "amx", "dot" or "widen"
// (TOKENMILL_BF16_PRODUCTS, else the CPU's rule; bfloat16_linear.cpp). Throws c10::ValueError,
// once per call, when the setting names a path this CPU cannot run or none at all.
std::string bfloat16_products();
at::Tensor pack_bfloat16_weight(const at::Tensor& weight);
at::Tensor bfloat16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const std::optional<at::Tensor>& bias);
at::Tensor dequantize_fp8(const at::Tensor& qweight, const at::Tensor& scales);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window,
                                  const std::optional<at::Tensor>& key_mask);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, int64_t window);
// prefill_attention on float32 FMAs whatever the CPU (prefill_attention_fma.cpp): q, k and v
// float32 or bfloat16, head_dim at most 256.
at::Tensor prefill_attention_fma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale, int64_t window);
at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor row_argmax(const at::Tensor& x);
// Logits' rows `rows` get -inf wherever the same row of xgrammar's int32 token bitmask is clear.
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                         const at::Tensor& rows);
void store_kv(const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
              const at::Tensor& v);
void store_kv_quantized(const at::Tensor& values, const at::Tensor& scales,
                        const at::Tensor& slot_mapping, const at::Tensor& k, const at::Tensor& v);
at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& values,
                                            const at::Tensor& scales,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale,
                                            int64_t window,
                                            const std::optional<at::Tensor>& key_mask);
// The quantized weights in panels of 8 rows (ops.pack_int8_panels / pack_int4_panels), n rows.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t n, int64_t group_size,
                       const std::optional<at::Tensor>& bias);
at::Tensor dequantize_int8(const at::Tensor& qweight, const at::Tensor& scales,
                           int64_t group_size, int64_t in_features);
at::Tensor dequantize_int4(const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t group_size, int64_t in_features);
// NF4 codes with double-quantized absmax (nf4_linear.cpp: layout and `second`).
at::Tensor nf4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& qabsmax,
                      const at::Tensor& second, int64_t group_size,
                      const std::optional<at::Tensor>& bias);
at::Tensor dequantize_nf4(const at::Tensor& codes, const at::Tensor& absmax, int64_t group_size,
                          int64_t in_features);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x,
                                                                    int64_t bits);
// W8A8 (w8a8.cpp): x's rows as asymmetric uint8 codes, and the rescale of oneDNN's int8 sums.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_tokens(const at::Tensor& x);
void w8a8_rescale_(const at::Tensor& y, const at::Tensor& scales, const at::Tensor& zeros,
                   const at::Tensor& row_sums, const std::optional<at::Tensor>& bias);
}  // namespace tokenmill
