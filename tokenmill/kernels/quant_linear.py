"""Products with an int8, int4 or Q5_0 weight (layouts in `quant_panels`), their dequantization,
and the rounding of x that the integer kernels apply; one implementation serves the three.

For up to QUANT_KERNEL_MAX_ROWS rows, native rounds x per block of 32 to integers (int8, scale
max|x| / 127, for int4 weights, as llama.cpp does; int16, max|x| / 32767, for int8 weights) and
multiplies in integers (Q5_0 rounds x as int4 does); the references round x the same way before
an fp32 product with the dequantized weight, so both backends compute one function
(tests/kernels/test_quant_linear.py bounds the difference, and the rounding's own error). Wider
x is multiplied in fp32 by the dequantized weight on both.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
from torch.nn import functional as F

from tokenmill.kernels.dispatch import native_or
from tokenmill.kernels.quant_panels import (
    QUANT_BLOCK,
    QuantPanels,
    pack_int4_panels,
    pack_int8_panels,
    pack_q5_0_panels,
    unpack_int4,
    unpack_q5_0,
)

# Above this many rows of x, expanding the weight to fp32 once and running torch's GEMM beats
# the integer kernel (measured per SmolLM2 layer for both formats; docs/quantization.md).
QUANT_KERNEL_MAX_ROWS = 64
# Weights expanded to fp32 at a time for a wide product: 8 MB, cache-resident until used.
DEQUANTIZE_TILE_WEIGHTS = 1 << 21
INT8_WEIGHT_ACTIVATION_BITS = 16
INT4_WEIGHT_ACTIVATION_BITS = 8


class IntegerFormat(NamedTuple):
    """What sets int8, int4 and Q5_0 weights apart for the shared code. A weight is the tuple
    of its tensors: (qweight, scales) for int8, (qweight, scales, mins) for int4, (qweight,
    qhigh, scales) for Q5_0; the first `code_tensors` hold the codes."""

    kind: str  # "int8", "int4" or "q5_0": the decode loop's LinearKernel constructor
    activation_bits: int  # x is rounded through blocks of this many bits
    product: str  # the native product's name
    dequantize: str  # the native dequantization's name
    code_tensors: int
    # (*code tensors, in_features) -> [N, K] integer values, which the scales multiply
    codes: Callable[..., torch.Tensor]
    pack: Callable[[tuple[torch.Tensor, ...], int], QuantPanels]  # (weight, in_features)


INT8 = IntegerFormat(
    "int8",
    INT8_WEIGHT_ACTIVATION_BITS,
    "int8_linear",
    "dequantize_int8",
    1,
    lambda qweight, in_features: qweight[:, :in_features],
    lambda weight, in_features: pack_int8_panels(*weight),
)
INT4 = IntegerFormat(
    "int4",
    INT4_WEIGHT_ACTIVATION_BITS,
    "int4_linear",
    "dequantize_int4",
    1,
    unpack_int4,
    lambda weight, in_features: pack_int4_panels(*weight, in_features),
)
# GGUF's Q5_0 at its own 5.5 bits a weight: w = scale * (q - 16), q in 0..31, groups of 32.
Q5_0 = IntegerFormat(
    "q5_0",
    INT4_WEIGHT_ACTIVATION_BITS,
    "q5_0_linear",
    "dequantize_q5_0",
    2,
    lambda qweight, qhigh, in_features: (
        unpack_q5_0(qweight, qhigh, in_features).to(torch.int8) - 16
    ),
    lambda weight, in_features: pack_q5_0_panels(*weight, in_features),
)
Q5_0_GROUP = 32


def quantized_fits(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """`native_friendly` for (x, bias), spelled out: it runs for every quantized product."""
    return (
        x.dtype == torch.float32
        and x.is_cpu
        and x.dim() >= 1
        and x.shape[-1] > 0
        and not (x.requires_grad and torch.is_grad_enabled())
        and (bias is None or bias.dtype == torch.float32)
    )


def _per_input(group_values: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[N, groups] -> [N, in_features] fp32: each group's value repeated over its inputs."""
    return group_values.float().repeat_interleave(group_size, dim=1)[:, :in_features]


def _dequantize_reference(
    fmt: IntegerFormat, weight: tuple[torch.Tensor, ...], group_size: int, in_features: int
) -> torch.Tensor:
    """codes * scale (+ min for int4), fp32 [N, in_features]."""
    scales, *mins = weight[fmt.code_tensors :]
    codes = fmt.codes(*weight[: fmt.code_tensors], in_features)
    values = codes.float() * _per_input(scales, group_size, in_features)
    for group_mins in mins:
        values = values + _per_input(group_mins, group_size, in_features)
    return values


@native_or(_dequantize_reference)
def _dequantize(
    native: ModuleType,
    fmt: IntegerFormat,
    weight: tuple[torch.Tensor, ...],
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    return getattr(native, fmt.dequantize)(*weight, group_size, in_features)


def _linear_reference(
    fmt: IntegerFormat,
    x: torch.Tensor,
    weight: tuple[torch.Tensor, ...],
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    dense = _dequantize_reference(fmt, weight, group_size, x.shape[-1])
    x = kernel_activations(x, fmt.activation_bits)
    return F.linear(x, dense.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _linear_fits(
    fmt: IntegerFormat,
    x: torch.Tensor,
    weight: tuple[torch.Tensor, ...],
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> bool:
    return quantized_fits(x, bias)


@native_or(_linear_reference, _linear_fits)
def _linear(
    native: ModuleType,
    fmt: IntegerFormat,
    x: torch.Tensor,
    weight: tuple[torch.Tensor, ...],
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    """Up to QUANT_KERNEL_MAX_ROWS rows of x: the panel kernel (packing the panels when not
    given); wider: torch's GEMM on the weight dequantized a tile at a time."""
    qweight = weight[0]
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.shape[0] > QUANT_KERNEL_MAX_ROWS:
        dequantize = getattr(native, fmt.dequantize)
        rows = lambda part: dequantize(  # noqa: E731
            *(t[part] for t in weight), group_size, x.shape[-1]
        )
        return tiled_dequantized_linear(flat, x.shape, qweight.shape[0], rows, bias)
    if panels is None:
        panels = fmt.pack(weight, x.shape[-1])
    out = getattr(native, fmt.product)(
        flat, *panels.tensors(), panels.out_features, group_size, bias
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the int8 weight w = (qweight, scales); x: [..., K]. `panels`
    is w from `pack_int8_panels`, which the native kernel reads (packed here when not given)."""
    return _linear(INT8, x, (qweight, scales), group_size, bias, panels)


def int8_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _linear_reference(INT8, x, (qweight, scales), group_size, bias)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the int4 weight w = (qweight, scales, mins); x: [..., K].
    `panels` is w from `pack_int4_panels`, which the native kernel reads (packed here when not
    given)."""
    return _linear(INT4, x, (qweight, scales, mins), group_size, bias, panels)


def int4_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _linear_reference(INT4, x, (qweight, scales, mins), group_size, bias)


def q5_0_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qhigh: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the Q5_0 weight w = (qweight, qhigh, scales); x: [..., K].
    `panels` is w from `pack_q5_0_panels`, which the native kernel reads (packed here when not
    given)."""
    return _linear(Q5_0, x, (qweight, qhigh, scales), Q5_0_GROUP, bias, panels)


def q5_0_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qhigh: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _linear_reference(Q5_0, x, (qweight, qhigh, scales), Q5_0_GROUP, bias)


def dequantize_q5_0(
    qweight: torch.Tensor, qhigh: torch.Tensor, scales: torch.Tensor, in_features: int
) -> torch.Tensor:
    """The fp32 weight [N, in_features] a Q5_0 (qweight, qhigh, scales) stands for."""
    return _dequantize(Q5_0, (qweight, qhigh, scales), Q5_0_GROUP, in_features)


def dequantize_q5_0_reference(
    qweight: torch.Tensor, qhigh: torch.Tensor, scales: torch.Tensor, in_features: int
) -> torch.Tensor:
    return _dequantize_reference(Q5_0, (qweight, qhigh, scales), Q5_0_GROUP, in_features)


def dequantize_int8(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int, in_features: int
) -> torch.Tensor:
    """The fp32 weight [N, in_features] an int8 (qweight, scales) pair stands for."""
    return _dequantize(INT8, (qweight, scales), group_size, in_features)


def dequantize_int8_reference(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int, in_features: int
) -> torch.Tensor:
    return _dequantize_reference(INT8, (qweight, scales), group_size, in_features)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """The fp32 weight [N, in_features] an int4 (qweight, scales, mins) triple stands for."""
    return _dequantize(INT4, (qweight, scales, mins), group_size, in_features)


def dequantize_int4_reference(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    return _dequantize_reference(INT4, (qweight, scales, mins), group_size, in_features)


def tiled_dequantized_linear(
    flat: torch.Tensor,
    shape: torch.Size,
    out_features: int,
    dequantize_rows: Callable[[slice], torch.Tensor],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """torch's GEMM on the weight expanded to fp32 a tile of output rows at a time
    (`dequantize_rows(rows)`): each tile (a few MB) is still in cache when the GEMM reads it, so
    DRAM sees only the packed bytes."""
    tile = max(1, DEQUANTIZE_TILE_WEIGHTS // flat.shape[1])
    if out_features <= tile:
        weight = dequantize_rows(slice(None))
        return F.linear(flat, weight, bias).view(*shape[:-1], out_features)
    out = torch.empty(flat.shape[0], out_features, dtype=flat.dtype)
    for start in range(0, out_features, tile):
        part = slice(start, start + tile)
        out[:, part] = F.linear(flat, dequantize_rows(part), None if bias is None else bias[part])
    return out.view(*shape[:-1], out_features)


def kernel_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x as the quantized products see it: rounded through `bits`-bit blocks of 32 when it has
    at most QUANT_KERNEL_MAX_ROWS rows, unchanged when wider."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > QUANT_KERNEL_MAX_ROWS:
        return x
    values, scales, _ = quantize_activations_reference(flat, bits)
    blocks = values.view(flat.shape[0], -1, QUANT_BLOCK).float() * scales[..., None]
    return blocks.view(flat.shape[0], -1)[:, : x.shape[-1]].view(x.shape).to(x.dtype)


def quantize_activations_reference(
    x: torch.Tensor, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the native quantized kernels make of fp32 x [M, K] before multiplying: int8 or
    int16 values [M, blocks * 32] (zero-padded), per-block scales max|x| / (2**(bits-1) - 1)
    [M, blocks] and scale * sum(values)."""
    rows, k = x.shape
    blocks = -(-k // QUANT_BLOCK)
    padded = F.pad(x.float(), (0, blocks * QUANT_BLOCK - k)).view(rows, blocks, QUANT_BLOCK)
    max_abs = padded.abs().amax(dim=-1)
    # Tensor / tensor: `127.0 / t` would be computed as 127 * (1 / t), rounding twice.
    limit = torch.full_like(max_abs, 2 ** (bits - 1) - 1)
    inverse = torch.where(max_abs > 0, limit / max_abs, torch.zeros_like(max_abs))
    dtype = torch.int8 if bits == 8 else torch.int16
    values = torch.round(padded * inverse[..., None]).to(dtype)
    scales = max_abs / limit
    sums = scales * values.sum(dim=-1, dtype=torch.int32).float()
    return values.view(rows, -1), scales, sums
