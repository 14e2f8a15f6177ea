"""Products with an fp8 weight (tokenmill/quant/fp8.py), and its dequantization.

qweight is float8_e4m3fn [N, K], w = scale * q with one float32 scale per row [N]. Up to
SKINNY_MAX_ROWS rows of x, native decodes the codes to fp32 in registers as it loads them and
multiplies in fp32 (csrc/linear.cpp); wider x multiplies by the weight dequantized tile by tile,
and the reference by the whole dequantized weight.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch.nn import functional as F

from tokenmill.kernels.dispatch import native_or
from tokenmill.kernels.float_linear import SKINNY_MAX_ROWS
from tokenmill.kernels.quant_linear import quantized_fits, tiled_dequantized_linear

# fp16 holds e4m3's bits with 8 more exponent bias: decoded values are the e4m3 values * 2^-8.
FP8_DECODE_SCALE = 256.0


def dequantize_fp8_reference(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's own fp8 -> fp32 cast is slow, so this moves bits instead: e4m3 bits s eeee mmm,
    sign-extended to 16 bits and shifted left by 7, are fp16's s eeeee mmmmmmmmmm with a stray
    copy of s in the top exponent bit; clearing it leaves an fp16 equal to the e4m3 value times
    2^-8, subnormals included (NaN codes never occur)."""
    bits = (qweight.view(torch.int8).to(torch.int16) << 7).bitwise_and_(~0x4000)
    return bits.view(torch.float16).float().mul_(scales[:, None] * FP8_DECODE_SCALE)


@native_or(dequantize_fp8_reference)
def dequantize_fp8(native: ModuleType, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] an fp8 (qweight, scales) pair stands for."""
    return native.dequantize_fp8(qweight, scales)


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    weight = dequantize_fp8_reference(qweight, scales).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _fp8_linear_fits(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    return quantized_fits(x, bias)


@native_or(fp8_linear_reference, _fp8_linear_fits)
def fp8_linear(
    native: ModuleType,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the fp8 weight w = (qweight, scales); x: [..., K]."""
    if x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS:  # decode: skip the reshapes
        return native.fp8_linear(x, qweight, scales, bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > SKINNY_MAX_ROWS:
        rows = lambda part: native.dequantize_fp8(qweight[part], scales[part])  # noqa: E731
        return tiled_dequantized_linear(flat, x.shape, qweight.shape[0], rows, bias)
    out = native.fp8_linear(flat, qweight, scales, bias)
    return out.view(*x.shape[:-1], qweight.shape[0])
