"""Every compute kernel under one name: `from tokenmill.kernels import ops`, then `ops.linear`,
`ops.paged_decode_attention`, ... Each op runs native AVX2/AVX-512/OpenMP code when the extension
loads and takes its inputs, else its pure-PyTorch reference (`*_reference`, which the tests
compare against); `dispatch.native_or` is that rule, `extension` the loading.

The ops live in modules by job: `float_linear`, `quant_panels`, `quant_linear`, `kquant_linear`,
`fp8_linear`, `nf4_linear`, `w8a8_linear`, `attention`, `kv_store`, `quantized_kv`,
`elementwise`, `token_bitmask`, `decode_loop`. This module only gathers them; tunables are read
(and patched) in the module that owns them. `ops._NATIVE` is `extension.NATIVE`, read and set
through here: setting it to None switches every op to its reference.
"""

from __future__ import annotations

import sys
from types import ModuleType

from tokenmill.kernels import extension
from tokenmill.kernels.attention import (
    masked_attention,
    paged_decode_attention,
    paged_decode_attention_reference,
    prefill_attention,
    prefill_attention_reference,
)
from tokenmill.kernels.decode_loop import (
    bfloat16_linear_kernel,
    decode_loop,
    decoder_layer_weights,
    float32_linear_kernel,
    fp8_linear_kernel,
    int4_linear_kernel,
    int8_linear_kernel,
    linear_kernel_max_rows,
    q5_0_linear_kernel,
    w8a8_linear_kernel,
)
from tokenmill.kernels.elementwise import (
    add_rms_norm,
    add_rms_norm_reference,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    rotary_embedding,
    rotary_embedding_reference,
    row_argmax,
    row_argmax_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from tokenmill.kernels.extension import (
    BACKEND_ENV,
    INTEL_CPU,
    amx_available,
    backend,
    bfloat16_products,
)
from tokenmill.kernels.float_linear import (
    BFLOAT16_PREPACKED_MAX_ROWS,
    BFLOAT16_SKINNY_MAX_ROWS,
    FLOAT32_PREPACKED_MAX_ROWS,
    PREPACKED_MAX_ROWS,
    SKINNY_MAX_ROWS,
    TORCH_PLAIN_MAX_ROWS,
    linear,
    linear_reference,
    prepack_linear_weight,
)
from tokenmill.kernels.fp8_linear import (
    FP8_DECODE_SCALE,
    dequantize_fp8,
    dequantize_fp8_reference,
    fp8_linear,
    fp8_linear_reference,
)
from tokenmill.kernels.kquant_linear import (
    Q6_K_SUB_BLOCK,
    Q6_K_SUPER_BLOCK,
    Q6KPanels,
    dequantize_q6_k_reference,
    pack_q6_k_panels,
    q6_k_linear,
    q6_k_linear_kernel,
    q6_k_linear_reference,
)
from tokenmill.kernels.kv_store import gather_blocks, store_kv, store_kv_reference
from tokenmill.kernels.nf4_linear import (
    NF4_KERNEL_MAX_ROWS,
    NF4_UNIT,
    NF4_VALUES,
    dequantize_absmax,
    dequantize_nf4,
    dequantize_nf4_reference,
    dynamic_map,
    nf4_linear,
    nf4_linear_kernel,
    nf4_linear_reference,
    second_level,
)
from tokenmill.kernels.quant_linear import (
    DEQUANTIZE_TILE_WEIGHTS,
    INT4_WEIGHT_ACTIVATION_BITS,
    INT8_WEIGHT_ACTIVATION_BITS,
    Q5_0_GROUP,
    QUANT_KERNEL_MAX_ROWS,
    dequantize_int4,
    dequantize_int4_reference,
    dequantize_int8,
    dequantize_int8_reference,
    dequantize_q5_0,
    dequantize_q5_0_reference,
    int4_linear,
    int4_linear_reference,
    int8_linear,
    int8_linear_reference,
    kernel_activations,
    q5_0_linear,
    q5_0_linear_reference,
    quantize_activations_reference,
)
from tokenmill.kernels.quant_panels import (
    PANEL_ROWS,
    QUANT_BLOCK,
    QuantPanels,
    pack_int4_panels,
    pack_int8_panels,
    pack_q5_0_panels,
    unpack_int4,
    unpack_q5_0,
)
from tokenmill.kernels.quantized_kv import (
    KV_CODE_MAX,
    dequantize_kv_reference,
    gather_blocks_dequantized,
    paged_decode_attention_quantized,
    paged_decode_attention_quantized_reference,
    quantize_kv_reference,
    store_kv_quantized,
    store_kv_quantized_reference,
)
from tokenmill.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_reference
from tokenmill.kernels.w8a8_linear import (
    ONEDNN_AVAILABLE,
    W8A8_PANEL_MAX_ROWS,
    OneDNNWeight,
    quantize_tokens,
    quantize_tokens_reference,
    w8a8_linear,
    w8a8_linear_reference,
    w8a8_panel_linear,
)

__all__ = [
    "BACKEND_ENV",
    "BFLOAT16_PREPACKED_MAX_ROWS",
    "BFLOAT16_SKINNY_MAX_ROWS",
    "DEQUANTIZE_TILE_WEIGHTS",
    "FLOAT32_PREPACKED_MAX_ROWS",
    "FP8_DECODE_SCALE",
    "INT4_WEIGHT_ACTIVATION_BITS",
    "INT8_WEIGHT_ACTIVATION_BITS",
    "INTEL_CPU",
    "KV_CODE_MAX",
    "NF4_KERNEL_MAX_ROWS",
    "NF4_UNIT",
    "NF4_VALUES",
    "ONEDNN_AVAILABLE",
    "PANEL_ROWS",
    "PREPACKED_MAX_ROWS",
    "Q5_0_GROUP",
    "Q6_K_SUB_BLOCK",
    "Q6_K_SUPER_BLOCK",
    "QUANT_BLOCK",
    "QUANT_KERNEL_MAX_ROWS",
    "SKINNY_MAX_ROWS",
    "TORCH_PLAIN_MAX_ROWS",
    "W8A8_PANEL_MAX_ROWS",
    "OneDNNWeight",
    "Q6KPanels",
    "QuantPanels",
    "add_rms_norm",
    "add_rms_norm_reference",
    "amx_available",
    "apply_token_bitmask",
    "apply_token_bitmask_reference",
    "backend",
    "bfloat16_linear_kernel",
    "bfloat16_products",
    "decode_loop",
    "decoder_layer_weights",
    "dequantize_absmax",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "dequantize_int4",
    "dequantize_int4_reference",
    "dequantize_int8",
    "dequantize_int8_reference",
    "dequantize_kv_reference",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "dequantize_q5_0",
    "dequantize_q5_0_reference",
    "dequantize_q6_k_reference",
    "dynamic_map",
    "float32_linear_kernel",
    "fp8_linear",
    "fp8_linear_kernel",
    "fp8_linear_reference",
    "gather_blocks",
    "gather_blocks_dequantized",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_reference",
    "int4_linear",
    "int4_linear_kernel",
    "int4_linear_reference",
    "int8_linear",
    "int8_linear_kernel",
    "int8_linear_reference",
    "kernel_activations",
    "linear",
    "linear_kernel_max_rows",
    "linear_reference",
    "masked_attention",
    "nf4_linear",
    "nf4_linear_kernel",
    "nf4_linear_reference",
    "pack_int4_panels",
    "pack_int8_panels",
    "pack_q5_0_panels",
    "pack_q6_k_panels",
    "paged_decode_attention",
    "paged_decode_attention_quantized",
    "paged_decode_attention_quantized_reference",
    "paged_decode_attention_reference",
    "prefill_attention",
    "prefill_attention_reference",
    "prepack_linear_weight",
    "q5_0_linear",
    "q5_0_linear_kernel",
    "q5_0_linear_reference",
    "q6_k_linear",
    "q6_k_linear_kernel",
    "q6_k_linear_reference",
    "quantize_activations_reference",
    "quantize_kv_reference",
    "quantize_tokens",
    "quantize_tokens_reference",
    "rotary_embedding",
    "rotary_embedding_reference",
    "row_argmax",
    "row_argmax_reference",
    "second_level",
    "silu_and_mul",
    "silu_and_mul_reference",
    "store_kv",
    "store_kv_quantized",
    "store_kv_quantized_reference",
    "store_kv_reference",
    "unpack_int4",
    "unpack_q5_0",
    "w8a8_linear",
    "w8a8_linear_kernel",
    "w8a8_linear_reference",
    "w8a8_panel_linear",
]


class _OpsModule(ModuleType):
    """This module's type: `_NATIVE` is a view of `extension.NATIVE`, the one switch every op
    reads, so `monkeypatch.setattr(ops, "_NATIVE", None)` runs every op's reference."""

    @property
    def _NATIVE(self) -> ModuleType | None:
        return extension.NATIVE

    @_NATIVE.setter
    def _NATIVE(self, native: ModuleType | None) -> None:
        extension.NATIVE = native


sys.modules[__name__].__class__ = _OpsModule
