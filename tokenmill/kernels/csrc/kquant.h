// The GGUF kernels of their own: Q6_K (and the q5_k layout, kquant_linear.cpp) and Q5_0
// (quant_linear.cpp, dequantize_weights.cpp). Their entry points for the bindings, and the
// check, scratch and team functions the decode loop calls (the conventions of team.h).

#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tokenmill {

// y = x W^T + b for float32 x [M, K] and a Q6_K weight in panels of 8 rows
// (ops.pack_q6_k_panels): values uint8 [panels, K / 32 * 256], sub_scales int8
// [panels, K / 16, 8], super_scales float16 [panels, K / 256, 8], and for Q4_K / Q5_K codes
// float32 mins [panels, K / 32, 8] (an undefined tensor: none); n = W's rows.
at::Tensor q6_k_linear(const at::Tensor& x, const at::Tensor& values,
                       const at::Tensor& sub_scales, const at::Tensor& super_scales,
                       const std::optional<at::Tensor>& mins, int64_t n,
                       const std::optional<at::Tensor>& bias);

void check_q6_k_panels(const char* op, const at::Tensor& values, const at::Tensor& sub_scales,
                       const at::Tensor& super_scales, const at::Tensor& mins, int64_t n,
                       int64_t k);
int64_t q6_k_linear_scratch_bytes(int64_t m, int64_t k);
void q6_k_linear_team(const at::Tensor& x, const at::Tensor& values,
                      const at::Tensor& sub_scales, const at::Tensor& super_scales,
                      const at::Tensor& mins, const float* bias, const at::Tensor& y,
                      void* scratch);

// y = x W^T + b for a GGUF Q5_0 weight in panels of 8 rows (ops.pack_q5_0_panels): values uint8
// [panels, K / 32 * 160], fp16 scales [panels, K / 32, 8]; group_size must be 32.
at::Tensor q5_0_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias);
// The fp32 weight [N, K] of Q5_0's row-major form: qweight int4's packed nibbles [N, K / 64 * 32
// rounded up], qhigh each block's fifth bits as GGUF's little-endian 32 bits [N, K / 32 * 4],
// scales float16 [N, K / 32].
at::Tensor dequantize_q5_0(const at::Tensor& qweight, const at::Tensor& qhigh,
                           const at::Tensor& scales, int64_t group_size, int64_t in_features);

void check_q5_0_panels(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       int64_t n, int64_t k);
int64_t q5_0_linear_scratch_bytes(int64_t m, int64_t k);
void q5_0_linear_team(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                      const float* bias, const at::Tensor& y, void* scratch);

}  // namespace tokenmill
