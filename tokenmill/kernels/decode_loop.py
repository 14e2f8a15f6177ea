"""The native decode loop (csrc/decode_loop.cpp): a whole decode step's layers in one call.

Each linear layer hands over its weights bound to the kernel that reads them (a handle from a
`*_linear_kernel` below, None where the layer has none and the loop cannot take it); the loop
then makes the same kernel calls as the Python layers, so the two give bit-identical results.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from tokenmill.kernels import extension
from tokenmill.kernels.dispatch import native_or, no_native_kernel
from tokenmill.kernels.float_linear import PREPACKED_MAX_ROWS, SKINNY_MAX_ROWS
from tokenmill.kernels.nf4_linear import NF4_KERNEL_MAX_ROWS
from tokenmill.kernels.quant_linear import (
    INT4,
    INT8,
    Q5_0,
    Q5_0_GROUP,
    QUANT_KERNEL_MAX_ROWS,
    IntegerFormat,
)
from tokenmill.kernels.quant_panels import QuantPanels
from tokenmill.kernels.w8a8_linear import W8A8, W8A8_PANEL_MAX_ROWS


def _float32_kernel_fits(
    weight: torch.Tensor, bias: torch.Tensor | None, prepacked: torch.Tensor | None = None
) -> bool:
    tensors = (weight,) if bias is None else (weight, bias)
    return all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)


@native_or(no_native_kernel, _float32_kernel_fits)
def float32_linear_kernel(
    native: ModuleType,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prepacked: torch.Tensor | None = None,
) -> object | None:
    """The native loop's handle on a float32 linear, with its packed copy when it has one
    (which then serves every product); None when the native kernels are off or the weights
    are not contiguous float32."""
    return native.LinearKernel.float32(weight, bias, prepacked)


def _integer_kernel_fits(
    fmt: IntegerFormat, panels: QuantPanels | None, group_size: int, bias: torch.Tensor | None
) -> bool:
    return panels is not None and (bias is None or bias.dtype == torch.float32)


@native_or(no_native_kernel, _integer_kernel_fits)
def _integer_linear_kernel(
    native: ModuleType,
    fmt: IntegerFormat,
    panels: QuantPanels,
    group_size: int,
    bias: torch.Tensor | None,
) -> object:
    make = getattr(native.LinearKernel, fmt.kind)
    return make(*panels.tensors(), panels.out_features, group_size, bias)


def int8_linear_kernel(
    panels: QuantPanels | None, group_size: int, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on an int8 linear, from its `pack_int8_panels` form."""
    return _integer_linear_kernel(INT8, panels, group_size, bias)


def w8a8_linear_kernel(
    panels: QuantPanels | None, group_size: int, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on a W8A8 (SmoothQuant) linear's int8 panels: int8's kernel,
    which the loop runs up to W8A8_PANEL_MAX_ROWS rows."""
    return _integer_linear_kernel(W8A8, panels, group_size, bias)


def int4_linear_kernel(
    panels: QuantPanels | None, group_size: int, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on an int4 linear, from its `pack_int4_panels` form."""
    return _integer_linear_kernel(INT4, panels, group_size, bias)


def q5_0_linear_kernel(panels: QuantPanels | None, bias: torch.Tensor | None) -> object | None:
    """The native loop's handle on a Q5_0 linear, from its `pack_q5_0_panels` form."""
    return _integer_linear_kernel(Q5_0, panels, Q5_0_GROUP, bias)


def _fp8_kernel_fits(
    qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    return bias is None or bias.dtype == torch.float32


@native_or(no_native_kernel, _fp8_kernel_fits)
def fp8_linear_kernel(
    native: ModuleType, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on an fp8 linear (the layout of `fp8_linear`)."""
    return native.LinearKernel.fp8(qweight, scales, bias)


def _bfloat16_kernel_fits(
    prepacked: torch.Tensor | None, out_features: int, bias: torch.Tensor | None
) -> bool:
    return (
        prepacked is not None
        and prepacked.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
    )


@native_or(no_native_kernel, _bfloat16_kernel_fits)
def bfloat16_linear_kernel(
    native: ModuleType,
    prepacked: torch.Tensor | None,
    out_features: int,
    bias: torch.Tensor | None,
) -> object | None:
    """The native loop's handle on a bfloat16 linear with its packed tiles (`prepack_linear_weight`
    on a CPU with AMX or AVX512-BF16); None without them."""
    return native.LinearKernel.bfloat16(prepacked, out_features, bias)


def linear_kernel_max_rows(kernel: Any) -> int:
    """The most rows of x the loop may hand this kernel: wider products run elsewhere (torch's
    GEMM, or the quantized weights expanded tile by tile). A float32 weight with a packed copy,
    and a bfloat16 one, take what the packed products take."""
    if (kernel.kind == "float32" and kernel.has_packed) or kernel.kind == "bfloat16":
        return PREPACKED_MAX_ROWS
    if kernel.kind == "nf4":
        return NF4_KERNEL_MAX_ROWS
    if kernel.kind == "w8a8":
        return W8A8_PANEL_MAX_ROWS
    return SKINNY_MAX_ROWS if kernel.kind in ("float32", "fp8") else QUANT_KERNEL_MAX_ROWS


def decoder_layer_weights(
    input_norm: torch.Tensor,
    qkv: object,
    o: object,
    mlp_norm: torch.Tensor,
    gate_up: object,
    down: object,
    rotary: tuple[torch.Tensor, torch.Tensor],
    window: int | None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    attention_out_norm: torch.Tensor | None = None,
    mlp_out_norm: torch.Tensor | None = None,
) -> object:
    """One decoder layer for `decode_loop`: the linears are handles from `*_linear_kernel`,
    `rotary` its (cos, sin) tables, `window` its sliding window; the last four are Gemma 3's
    extra norms (None for Llama)."""
    native = extension.NATIVE
    assert native is not None, "decoder layers exist only with the native kernels"
    cos, sin = rotary
    return native.DecoderLayerWeights(
        input_norm,
        qkv,
        o,
        mlp_norm,
        gate_up,
        down,
        cos,
        sin,
        window or 0,
        q_norm,
        k_norm,
        attention_out_norm,
        mlp_out_norm,
    )


def decode_loop(
    layers: list[object],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    activation: str,
) -> object:
    """A stack of decoder layers run in one call, `activation` "silu" or "gelu_tanh":
    `.run(hidden, positions, kv_caches, kv_scales, slot_mappings, block_tables, seq_lens,
    key_mask=None, op_ns=None)`, the slot mappings and block tables one per layer (shared within
    a KV-cache group), the key mask `paged_decode_attention`'s, `op_ns` the per-kernel clock
    (tokenmill/kernels/op_timer.py) -> (last layer's output, residual)."""
    native = extension.NATIVE
    assert native is not None, "the decode loop exists only with the native kernels"
    return native.DecodeLoop(layers, num_heads, num_kv_heads, head_dim, eps, scale, activation)
