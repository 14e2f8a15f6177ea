// Python bindings of the native kernels; the modules of tokenmill/kernels (through ops) are their
// only callers.

#include <torch/extension.h>

#include "decode_loop.h"
#include "kernels.h"
#include "kquant.h"

// The GIL is released while a kernel runs, as torch's own operators do, so other Python
// threads (the server's event loop) keep going.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &tokenmill::skinny_linear,
        "y = x W^T + b for skinny float32 x [M, K], W float32 or bfloat16, y float32",
        py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_linear_weight", &tokenmill::pack_linear_weight,
        "float32 W [N, K] as panels of 16 rows, k-major [ceil(N / 16), K, 16], for packed_linear",
        py::arg("weight"), py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear", &tokenmill::packed_linear,
        "y = x W^T + b for float32 x [M, K] with W from pack_linear_weight (n = W's rows)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_available", &tokenmill::amx_available,
        "whether this CPU and OS run AMX tiles (asks Linux for the tile state once)");
  m.def("bfloat16_products", &tokenmill::bfloat16_products,
        "the path of bfloat16_linear: amx, dot or widen (TOKENMILL_BF16_PRODUCTS, else the CPU's)");
  m.def("pack_bfloat16_weight", &tokenmill::pack_bfloat16_weight,
        "bfloat16 W [N, K] as AMX B tiles [ceil(N / 16), ceil(K / 32) * 16, 16, 2] for "
        "bfloat16_linear",
        py::arg("weight"), py::call_guard<py::gil_scoped_release>());
  m.def("bfloat16_linear", &tokenmill::bfloat16_linear,
        "y = x W^T + b in bfloat16 (AMX, AVX512-BF16 or float32 FMAs), W from "
        "pack_bfloat16_weight (n = W's rows)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("fp8_linear", &tokenmill::fp8_linear,
        "y = x W^T + b for skinny float32 x, W fp8 e4m3 with a float32 scale per row",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_fp8", &tokenmill::dequantize_fp8, "fp8 weight to float32 [N, K]",
        py::arg("qweight"), py::arg("scales"), py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &tokenmill::paged_decode_attention,
        "one-token-per-sequence attention read through the block tables", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("key_mask") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention", &tokenmill::prefill_attention,
        "causal attention of q [n, H, d], the last n of k and v's [S, KVH, d]: on AMX tiles "
        "where they take it, else on FMAs",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_fma", &tokenmill::prefill_attention_fma,
        "prefill_attention on float32 FMAs (float32 or bfloat16 q, k, v), on any CPU",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
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
        py::arg("key_mask") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &tokenmill::silu_and_mul, "silu(x[..., :F]) * x[..., F:]", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gelu_tanh_and_mul", &tokenmill::gelu_tanh_and_mul,
        "gelu(x[..., :F], approximate='tanh') * x[..., F:]", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("row_argmax", &tokenmill::row_argmax,
        "each row's index of its largest value, the first on ties (NaN counts as largest)",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("apply_token_bitmask", &tokenmill::apply_token_bitmask,
        "logits[rows] = -inf where the same rows of the int32 token bitmask are clear",
        py::arg("logits"), py::arg("bitmask"), py::arg("rows"),
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &tokenmill::int8_linear,
        "y = x W^T + b, W int8 in panels of 8 rows (ops.pack_int8_panels), n = W's rows",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("n"), py::arg("group_size"),
        py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear", &tokenmill::int4_linear,
        "y = x W^T + b, W int4 in panels of 8 rows (ops.pack_int4_panels), n = W's rows",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("mins"), py::arg("n"),
        py::arg("group_size"), py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_int8", &tokenmill::dequantize_int8, "int8 weight to float32 [N, K]",
        py::arg("qweight"), py::arg("scales"), py::arg("group_size"), py::arg("in_features"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_int4", &tokenmill::dequantize_int4, "int4 weight to float32 [N, K]",
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("group_size"),
        py::arg("in_features"), py::call_guard<py::gil_scoped_release>());
  m.def("nf4_linear", &tokenmill::nf4_linear,
        "y = x W^T + b, W NF4 codes with double-quantized absmax (ops.nf4_linear)", py::arg("x"),
        py::arg("codes"), py::arg("qabsmax"), py::arg("second"), py::arg("group_size"),
        py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_nf4", &tokenmill::dequantize_nf4,
        "NF4 codes to float32 [N, K], given each group's absmax as float32 [N, groups]",
        py::arg("codes"), py::arg("absmax"), py::arg("group_size"),
        py::arg("in_features"), py::call_guard<py::gil_scoped_release>());
  m.def("q6_k_linear", &tokenmill::q6_k_linear,
        "y = x W^T + b, W Q6_K in panels of 8 rows (ops.pack_q6_k_panels), n = W's rows",
        py::arg("x"), py::arg("values"), py::arg("sub_scales"), py::arg("super_scales"),
        py::arg("mins"), py::arg("n"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("q5_0_linear", &tokenmill::q5_0_linear,
        "y = x W^T + b, W Q5_0 in panels of 8 rows (ops.pack_q5_0_panels), n = W's rows",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("n"), py::arg("group_size"),
        py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_q5_0", &tokenmill::dequantize_q5_0, "Q5_0 weight to float32 [N, K]",
        py::arg("qweight"), py::arg("qhigh"), py::arg("scales"), py::arg("group_size"),
        py::arg("in_features"), py::call_guard<py::gil_scoped_release>());
  m.def("quantize_activations", &tokenmill::quantize_activations,
        "float32 rows to int8/int16 blocks of 32: (values, scales, scale * sum of values)",
        py::arg("x"), py::arg("bits"), py::call_guard<py::gil_scoped_release>());
  m.def("quantize_tokens", &tokenmill::quantize_tokens,
        "float32 rows to asymmetric uint8 codes: (codes [T, K], scales [T], zero points [T])",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("w8a8_rescale_", &tokenmill::w8a8_rescale_,
        "in place: y = (y - zeros[t] * row_sums[n]) * scales[t] + bias[n]", py::arg("y"),
        py::arg("scales"), py::arg("zeros"), py::arg("row_sums"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());

  using tokenmill::LinearKernel;
  py::class_<LinearKernel>(m, "LinearKernel",
                           "a linear layer's weights and the kernels that read them")
      .def_static("float32", &LinearKernel::float32, py::arg("weight"), py::arg("bias"),
                  py::arg("packed"))
      .def_property_readonly("kind",
                             [](const LinearKernel& k) {
                               switch (k.kind) {
                                 case LinearKernel::Kind::kInt8:
                                   return "int8";
                                 case LinearKernel::Kind::kW8a8:
                                   return "w8a8";
                                 case LinearKernel::Kind::kInt4:
                                   return "int4";
                                 case LinearKernel::Kind::kFp8:
                                   return "fp8";
                                 case LinearKernel::Kind::kBfloat16:
                                   return "bfloat16";
                                 case LinearKernel::Kind::kNf4:
                                   return "nf4";
                                 case LinearKernel::Kind::kQ6K:
                                   return "q6_k";
                                 case LinearKernel::Kind::kQ50:
                                   return "q5_0";
                                 default:
                                   return "float32";
                               }
                             })
      .def_property_readonly("has_packed",
                             [](const LinearKernel& k) { return k.packed.defined(); })
      .def_static("int8", &LinearKernel::int8, py::arg("values"), py::arg("scales"),
                  py::arg("n"), py::arg("group_size"), py::arg("bias"))
      .def_static("w8a8", &LinearKernel::w8a8, py::arg("values"), py::arg("scales"),
                  py::arg("n"), py::arg("group_size"), py::arg("bias"))
      .def_static("int4", &LinearKernel::int4, py::arg("values"), py::arg("scales"),
                  py::arg("mins"), py::arg("n"), py::arg("group_size"), py::arg("bias"))
      .def_static("fp8", &LinearKernel::fp8, py::arg("qweight"), py::arg("scales"),
                  py::arg("bias"))
      .def_static("bfloat16", &LinearKernel::bfloat16, py::arg("packed"), py::arg("n"),
                  py::arg("bias"))
      .def_static("nf4", &LinearKernel::nf4, py::arg("codes"), py::arg("qabsmax"),
                  py::arg("second"), py::arg("group_size"), py::arg("bias"))
      .def_static("q5_0", &LinearKernel::q5_0, py::arg("values"), py::arg("scales"),
                  py::arg("n"), py::arg("group_size"), py::arg("bias"))
      .def_static("q6_k", &LinearKernel::q6_k, py::arg("values"), py::arg("sub_scales"),
                  py::arg("super_scales"), py::arg("mins"), py::arg("n"), py::arg("bias"));
  using OptionalTensor = std::optional<at::Tensor>;
  py::class_<tokenmill::DecoderLayerWeights>(m, "DecoderLayerWeights")
      .def(py::init([](at::Tensor input_norm, LinearKernel qkv, LinearKernel o,
                       at::Tensor mlp_norm, LinearKernel gate_up, LinearKernel down,
                       at::Tensor cos, at::Tensor sin, int64_t window, OptionalTensor q_norm,
                       OptionalTensor k_norm, OptionalTensor attention_out_norm,
                       OptionalTensor mlp_out_norm) {
             return tokenmill::DecoderLayerWeights{
                 std::move(input_norm),   std::move(qkv),  std::move(o),
                 std::move(mlp_norm),     std::move(gate_up), std::move(down),
                 std::move(cos),          std::move(sin),  window,
                 q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()),
                 attention_out_norm.value_or(at::Tensor()), mlp_out_norm.value_or(at::Tensor())};
           }),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o"), py::arg("mlp_norm"),
           py::arg("gate_up"), py::arg("down"), py::arg("cos"), py::arg("sin"),
           py::arg("window"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("attention_out_norm"), py::arg("mlp_out_norm"));
  py::class_<tokenmill::DecodeLoop>(m, "DecodeLoop",
                                    "every decoder layer of a decode step in one call")
      .def(py::init([](std::vector<tokenmill::DecoderLayerWeights> layers, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                       const std::string& activation) {
             TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
                         "DecodeLoop: activation must be 'silu' or 'gelu_tanh'");
             const auto kind = activation == "silu" ? tokenmill::GatedActivation::kSilu
                                                    : tokenmill::GatedActivation::kGeluTanh;
             return tokenmill::DecodeLoop(std::move(layers), num_heads, num_kv_heads, head_dim,
                                          eps, scale, kind);
           }),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("activation"))
      .def("run", &tokenmill::DecodeLoop::run, py::arg("hidden"), py::arg("positions"),
           py::arg("kv_caches"), py::arg("kv_scales"), py::arg("slot_mappings"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("key_mask") = py::none(),
           py::arg("op_ns") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly_static("OP_NAMES", [](py::object) {
        return std::vector<std::string>(std::begin(tokenmill::kLoopOpNames),
                                        std::end(tokenmill::kLoopOpNames));
      });
}
