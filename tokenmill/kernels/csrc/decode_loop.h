// The native decode loop's types, shared by decode_loop.cpp and the Python bindings.

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "team.h"

namespace tokenmill {

// One linear layer's weights in a format the skinny kernels read, and the kernel to use; a
// float32 layer may also carry a packed copy (pack_linear_weight), which then serves every
// product. A bfloat16 model's layers run on pack_bfloat16_weight's copy, on the path
// bfloat16_linear.cpp chose for the CPU.
struct LinearKernel {
  // kW8a8: a SmoothQuant weight's int8 panels, run as kInt8 (the loop takes it only for the rows
  // where the panels beat oneDNN's GEMM: ops.W8A8_PANEL_MAX_ROWS).
  enum class Kind { kFloat32, kInt8, kInt4, kFp8, kBfloat16, kNf4, kQ6K, kQ50, kW8a8 };

  Kind kind;
  // float32 [N, K], fp8 codes [N, K], int8 / int4 / Q6_K / Q5_0 panels, NF4 codes, or bfloat16 B tiles
  at::Tensor weight;
  at::Tensor scales;  // NF4: its qabsmax; Q6_K: the sub-block scales
  at::Tensor mins;    // NF4: its `second` (nf4_linear.cpp); Q6_K: the block mins (Q4_K / Q5_K
                      // codes), undefined without
  int64_t group_size;
  std::optional<at::Tensor> bias;  // float32 (a bfloat16 layer's, widened once)
  at::Tensor packed;     // float32's packed copy; undefined: none
  int64_t out_features;  // N, which int8 / int4 panels (padded to 8 rows) do not tell
  at::Tensor super_scales;  // Q6_K's

  static LinearKernel float32(at::Tensor weight, std::optional<at::Tensor> bias,
                              std::optional<at::Tensor> packed);
  static LinearKernel int8(at::Tensor values, at::Tensor scales, int64_t n, int64_t group_size,
                           std::optional<at::Tensor> bias);
  static LinearKernel w8a8(at::Tensor values, at::Tensor scales, int64_t n, int64_t group_size,
                           std::optional<at::Tensor> bias);
  static LinearKernel int4(at::Tensor values, at::Tensor scales, at::Tensor mins, int64_t n,
                           int64_t group_size, std::optional<at::Tensor> bias);
  static LinearKernel fp8(at::Tensor qweight, at::Tensor scales, std::optional<at::Tensor> bias);
  static LinearKernel bfloat16(at::Tensor packed, int64_t n, std::optional<at::Tensor> bias);
  static LinearKernel nf4(at::Tensor codes, at::Tensor qabsmax, at::Tensor second,
                          int64_t group_size, std::optional<at::Tensor> bias);
  static LinearKernel q5_0(at::Tensor values, at::Tensor scales, int64_t n, int64_t group_size,
                           std::optional<at::Tensor> bias);
  static LinearKernel q6_k(at::Tensor values, at::Tensor sub_scales, at::Tensor super_scales,
                           std::optional<at::Tensor> mins, int64_t n,
                           std::optional<at::Tensor> bias);

  // Throws unless the weights hold n outputs of k inputs; `name` says which layer.
  void check(const std::string& name, int64_t k, int64_t n) const;
  // Bytes of scratch a product of m rows of k inputs needs (team.h).
  int64_t scratch_bytes(int64_t m, int64_t k) const;
  // y [M, N] = x [M, K] W^T + b, over the threads of the enclosing parallel region (team.h).
  void run(const at::Tensor& x, const at::Tensor& y, void* scratch) const;
};

// One decoder layer: pre-norm, merged q/k/v, attention, output projection, pre-norm, merged
// gate/up, down. Gemma 3 adds the optional parts: per-head q and k norms and norms of the
// attention and MLP outputs (undefined tensors for Llama). Each layer has its own rotary table
// and sliding window (0: the whole context), as Gemma's local and global layers differ. The norms
// are float32 with float32, fp8 or integer linears and bfloat16 with bfloat16 ones: the model's
// dtype, which its activations and KV caches then have too.
struct DecoderLayerWeights {
  at::Tensor input_norm;
  LinearKernel qkv;
  LinearKernel o;
  at::Tensor mlp_norm;
  LinearKernel gate_up;
  LinearKernel down;
  at::Tensor cos;
  at::Tensor sin;
  int64_t window;
  at::Tensor q_norm;
  at::Tensor k_norm;
  at::Tensor attention_out_norm;
  at::Tensor mlp_out_norm;
};

// The loop's kernels by kind, for a profile of its time (DecodeLoop::run's `op_ns`): Gemma's extra
// norms count as kNorm.
enum class LoopOp : int {
  kNorm, kQkv, kRotary, kStoreKv, kAttention, kO, kGateUp, kActivation, kDown, kCount
};
constexpr const char* kLoopOpNames[] = {"norm", "qkv",     "rotary",     "store_kv", "attention",
                                        "o",    "gate_up", "activation", "down"};
static_assert(sizeof(kLoopOpNames) / sizeof(kLoopOpNames[0]) ==
                  static_cast<size_t>(LoopOp::kCount),
              "one name per LoopOp");

class DecodeLoop {
 public:
  DecodeLoop(std::vector<DecoderLayerWeights> layers, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double eps, double scale, GatedActivation activation);

  // Every layer over `hidden` [T, D], each token attending to its sequence's paged KV: the
  // caches have the model's dtype (float32, or bfloat16 with the hidden states), or are int8 /
  // fp8 codes when `kv_scales` holds their scales. Each layer writes through its own
  // `slot_mappings` entry and reads through its own `block_tables` entry (the layers of one
  // KV-cache group pass the same tensors). Returns
  // (last layer's output, residual stream before it), which the final norm adds together.
  // `key_mask`: paged_decode_attention_team's, the same for every layer (a draft tree's).
  // With `op_ns` (int64 [LoopOp::kCount]), each kind of kernel's wall time in nanoseconds is
  // added to its entry, read by the first thread after the barrier that ends each kernel.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& positions,
                                         const std::vector<at::Tensor>& kv_caches,
                                         const std::vector<at::Tensor>& kv_scales,
                                         const std::vector<at::Tensor>& slot_mappings,
                                         const std::vector<at::Tensor>& block_tables,
                                         const at::Tensor& seq_lens,
                                         const std::optional<at::Tensor>& key_mask = {},
                                         const std::optional<at::Tensor>& op_ns = {}) const;

 private:
  std::vector<DecoderLayerWeights> layers_;
  int64_t num_heads_;
  int64_t num_kv_heads_;
  int64_t head_dim_;
  double eps_;
  double scale_;
  GatedActivation activation_;
  int64_t hidden_size_;
  at::ScalarType dtype_;  // the norms', activations' and KV caches' (float32 or bfloat16)
  int64_t max_positions_;  // rows of the shortest rotary table
};

}  // namespace tokenmill
