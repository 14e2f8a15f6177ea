// Python bindings of the native kernels; tokenmill/kernels/ops.py is their only caller.

#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace tokenmill {
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window);
at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
void store_kv(const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
              const at::Tensor& v);
void store_kv_quantized(const at::Tensor& values, const at::Tensor& scales,
                        const at::Tensor& slot_mapping, const at::Tensor& k, const at::Tensor& v);
at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& values,
                                            const at::Tensor& scales,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale,
                                            int64_t window);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group_size, const std::optional<at::Tensor>& bias);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group_size,
                       const std::optional<at::Tensor>& bias);
at::Tensor dequantize_int8(const at::Tensor& qweight, const at::Tensor& scales,
                           int64_t group_size, int64_t in_features);
at::Tensor dequantize_int4(const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t group_size, int64_t in_features);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x,
                                                                    int64_t bits);
}  // namespace tokenmill

// The GIL is released while a kernel runs, as torch's own operators do, so other Python
// threads (the server's event loop) keep going.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &tokenmill::skinny_linear, "y = x W^T + b for skinny float32 x [M, K]",
        py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &tokenmill::paged_decode_attention,
        "one-token-per-sequence attention read through the block tables", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &tokenmill::add_rms_norm,
        "residual += x in place (when given), then RMSNorm of the sum into a new tensor",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &tokenmill::rotary_embedding,
        "GPT-NeoX rotary embedding applied in place to q [T, H, d] and k [T, KVH, d]",
        py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"),
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &tokenmill::store_kv,
        "k and v [T, kv_heads, d] into the paged cache's slots (block * block_size + offset)",
        py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("k"), py::arg("v"),
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kv_quantized", &tokenmill::store_kv_quantized,
        "k and v quantized per token and head (int8 or fp8 codes, fp32 scales) into their slots",
        py::arg("values"), py::arg("scales"), py::arg("slot_mapping"), py::arg("k"), py::arg("v"),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention_quantized", &tokenmill::paged_decode_attention_quantized,
        "paged_decode_attention over int8 or fp8 codes dequantized in place by their scales",
        py::arg("q"), py::arg("values"), py::arg("scales"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &tokenmill::silu_and_mul, "silu(x[..., :F]) * x[..., F:]", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &tokenmill::int8_linear,
        "y = x W^T + b, W int8 with a scale per row and group of inputs", py::arg("x"),
        py::arg("qweight"), py::arg("scales"), py::arg("group_size"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear", &tokenmill::int4_linear,
        "y = x W^T + b, W int4 with a scale and min per row and group of inputs", py::arg("x"),
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("group_size"),
        py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_int8", &tokenmill::dequantize_int8, "int8 weight to float32 [N, K]",
        py::arg("qweight"), py::arg("scales"), py::arg("group_size"), py::arg("in_features"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_int4", &tokenmill::dequantize_int4, "int4 weight to float32 [N, K]",
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("group_size"),
        py::arg("in_features"), py::call_guard<py::gil_scoped_release>());
  m.def("quantize_activations", &tokenmill::quantize_activations,
        "float32 rows to int8/int16 blocks of 32: (values, scales, scale * sum of values)",
        py::arg("x"), py::arg("bits"), py::call_guard<py::gil_scoped_release>());
}
