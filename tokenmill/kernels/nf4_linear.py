"""Products with an NF4 weight (tokenmill/quant/nf4.py), and its dequantization.

An NF4 weight is four tensors, bitsandbytes' format with its row blocks kept apart:
  qweight  uint8 [N, K' / 2]: codes 0..15, K' = K padded to whole groups, each 64 inputs in 32
           bytes in the int4 layout (input i in the low nibble of byte i, 32 + i in the high);
  qabsmax  uint8 [N, groups]: each group's absmax, double-quantized: absmax = map[q] * a2 + c;
  absmax2  float32 [ceil(N * groups / 256)]: a2, one per 256 consecutive groups (row-major);
  offset   float32 [1]: c, the mean the absmax were centered on.
w = NF4_VALUES[code] * absmax, with `map` bitsandbytes' signed dynamic 8-bit map.

Up to NF4_KERNEL_MAX_ROWS rows of x, native decodes the codes in registers and multiplies in
fp32 (csrc/nf4_linear.cpp); wider x multiplies by the weight dequantized tile by tile, and the
reference by the whole dequantized weight.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
from torch.nn import functional as F

from tokenmill.kernels.dispatch import native_or, no_native_kernel
from tokenmill.kernels.float_linear import SKINNY_MAX_ROWS
from tokenmill.kernels.quant_linear import quantized_fits, tiled_dequantized_linear
from tokenmill.kernels.quant_panels import unpack_int4

# QLoRA's 4-bit NormalFloat: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero
# (bitsandbytes' table, to the bit).
NF4_VALUES = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)
NF4_UNIT = 64  # inputs per 32 bytes of codes; every group size is a multiple of it
SECOND_BLOCK = 256  # absmax per second-level scale
NF4_KERNEL_MAX_ROWS = SKINNY_MAX_ROWS


@cache
def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map()`), the codebook of the
    double-quantized absmax: 7 decades of exponent, each with fewer fraction steps below it,
    plus 0 and 1; 256 sorted fp32 values."""
    exponent_bits, value_bits = 7, 7
    data: list[float] = []
    for i in range(exponent_bits):
        steps = 2 ** (i + value_bits - exponent_bits) + 1
        bounds = torch.linspace(0.1, 1, steps, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        decade = 10 ** (-(exponent_bits - 1) + i)
        # Scaled in fp32, as bitsandbytes does, so the map is its map to the bit.
        data += (decade * means).tolist() + (-decade * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def second_level(absmax2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The float side of the double quantization as the native kernels read it:
    [offset, map[0..255], absmax2...] in one fp32 tensor."""
    return torch.cat((offset.float().reshape(1), dynamic_map(), absmax2.float().reshape(-1)))


def dequantize_absmax(
    qabsmax: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """fp32 absmax [N, groups]: map[q] * a2 (one per 256 groups) + offset, as bitsandbytes'
    `dequantize_blockwise` and then the offset."""
    flat = qabsmax.reshape(-1).long()
    per_block = absmax2.float().repeat_interleave(SECOND_BLOCK)[: flat.numel()]
    return (dynamic_map()[flat] * per_block + offset.float()).view(qabsmax.shape)


def dequantize_nf4_reference(
    qweight: torch.Tensor,
    qabsmax: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    codes = unpack_int4(qweight, qweight.shape[1] * 2).long()
    absmax = dequantize_absmax(qabsmax, absmax2, offset)
    values = NF4_VALUES[codes].view(codes.shape[0], -1, group_size) * absmax[..., None]
    return values.view(codes.shape[0], -1)[:, :in_features]


@native_or(dequantize_nf4_reference)
def dequantize_nf4(
    native: ModuleType,
    qweight: torch.Tensor,
    qabsmax: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """The fp32 weight [N, in_features] an NF4 weight stands for."""
    absmax = dequantize_absmax(qabsmax, absmax2, offset)
    return native.dequantize_nf4(qweight, absmax, group_size, in_features)


def nf4_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qabsmax: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    second: torch.Tensor | None = None,
) -> torch.Tensor:
    weight = dequantize_nf4_reference(qweight, qabsmax, absmax2, offset, group_size, x.shape[-1])
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _nf4_linear_fits(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qabsmax: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    second: torch.Tensor | None = None,
) -> bool:
    return quantized_fits(x, bias)


@native_or(nf4_linear_reference, _nf4_linear_fits)
def nf4_linear(
    native: ModuleType,
    x: torch.Tensor,
    qweight: torch.Tensor,
    qabsmax: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    second: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the NF4 weight w = (qweight, qabsmax, absmax2, offset);
    x: [..., K]. `second` is `second_level(absmax2, offset)`, made here when not given."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > NF4_KERNEL_MAX_ROWS:
        absmax = dequantize_absmax(qabsmax, absmax2, offset)
        rows = lambda part: native.dequantize_nf4(  # noqa: E731
            qweight[part], absmax[part], group_size, x.shape[-1]
        )
        return tiled_dequantized_linear(flat, x.shape, qweight.shape[0], rows, bias)
    if second is None:
        second = second_level(absmax2, offset)
    out = native.nf4_linear(flat, qweight, qabsmax, second, group_size, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


def _nf4_kernel_fits(
    qweight: torch.Tensor,
    qabsmax: torch.Tensor,
    second: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> bool:
    return second is not None and (bias is None or bias.dtype == torch.float32)


@native_or(no_native_kernel, _nf4_kernel_fits)
def nf4_linear_kernel(
    native: ModuleType,
    qweight: torch.Tensor,
    qabsmax: torch.Tensor,
    second: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> object | None:
    """The native loop's handle on an NF4 linear (`second` from `second_level`)."""
    return native.LinearKernel.nf4(qweight, qabsmax, second, group_size, bias)
