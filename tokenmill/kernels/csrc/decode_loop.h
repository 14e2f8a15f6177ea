// The native decode loop's types, shared by decode_loop.cpp and the Python bindings.

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace tokenmill {

// One linear layer's weights in a format the skinny kernels read, and the kernel to use.
struct LinearKernel {
  enum class Kind { kFloat32, kInt8, kInt4 };

  Kind kind;
  at::Tensor weight;  // float32 [N, K], or the packed int8 / int4 codes
  at::Tensor scales;
  at::Tensor mins;
  int64_t group_size;
  std::optional<at::Tensor> bias;

  static LinearKernel float32(at::Tensor weight, std::optional<at::Tensor> bias);
  static LinearKernel int8(at::Tensor qweight, at::Tensor scales, int64_t group_size,
                           std::optional<at::Tensor> bias);
  static LinearKernel int4(at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                           int64_t group_size, std::optional<at::Tensor> bias);

  at::Tensor operator()(const at::Tensor& x) const;
};

// A Llama decoder layer: pre-norms, merged q/k/v, output projection, merged gate/up, down.
struct DecoderLayerWeights {
  at::Tensor input_norm;
  LinearKernel qkv;
  LinearKernel o;
  at::Tensor post_norm;
  LinearKernel gate_up;
  LinearKernel down;
};

class LlamaDecodeLoop {
 public:
  LlamaDecodeLoop(std::vector<DecoderLayerWeights> layers, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                  at::Tensor cos, at::Tensor sin);

  // Every layer over `hidden` [T, D], each token attending to its sequence's paged KV: the
  // caches are float32, or int8 / fp8 codes when `kv_scales` holds their scales. Returns
  // (last MLP output, residual stream before it), which the final norm adds together.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& positions,
                                         const std::vector<at::Tensor>& kv_caches,
                                         const std::vector<at::Tensor>& kv_scales,
                                         const at::Tensor& slot_mapping,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens) const;

 private:
  std::vector<DecoderLayerWeights> layers_;
  int64_t num_heads_;
  int64_t num_kv_heads_;
  int64_t head_dim_;
  double eps_;
  double scale_;
  at::Tensor cos_;
  at::Tensor sin_;
};

}  // namespace tokenmill
