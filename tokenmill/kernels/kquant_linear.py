"""Products with a Q6_K weight, GGUF's 6-bit k-quant, kept in its super-block form: w = d * s * q
with q in -32..31, an int8 scale s per 16 inputs and an fp16 scale d per 256.

Row-major form (tokenmill.quant.kquant holds it; K a multiple of 256):
  qweight int8 [N, K], sub_scales int8 [N, K / 16], super_scales float16 [N, K / 256], and
  optionally mins float32 [N, K / 32]: w = d * s * q + min, which holds Q5_K's codes 0..31 and
  Q4_K's 0..15 exactly too (their 6-bit scale s repeated over a block's two halves).
The native kernel (csrc/kquant_linear.cpp) reads a copy in panels of 8 rows (`pack_q6_k_panels`):
the codes as `pack_int8_panels` lays out int8 weights, the scales as [panels, groups, 8].

As for int8 weights, up to QUANT_KERNEL_MAX_ROWS rows of x are rounded to int16 per block of 32
and multiplied in integers, each block's two halves scaled by their own s (exact: d * s is one
fp32 rounding, as in the dequantization); the reference rounds x the same way before an fp32
product with the dequantized weight. Wider x is multiplied in fp32 by the dequantized weight.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
from torch.nn import functional as F

from tokenmill.kernels.dispatch import native_or, no_native_kernel
from tokenmill.kernels.quant_linear import (
    INT8_WEIGHT_ACTIVATION_BITS,
    QUANT_KERNEL_MAX_ROWS,
    kernel_activations,
    quantized_fits,
    tiled_dequantized_linear,
)
from tokenmill.kernels.quant_panels import PANEL_ROWS, QUANT_BLOCK, pack_int8_panels

Q6_K_SUPER_BLOCK = 256
Q6_K_SUB_BLOCK = 16


class Q6KPanels(NamedTuple):
    """A Q6_K weight regrouped for the native kernel: panels of PANEL_ROWS output rows."""

    values: torch.Tensor  # uint8 [panels, K / 32 * 256], `pack_int8_panels`' layout
    sub_scales: torch.Tensor  # int8 [panels, K / 16, PANEL_ROWS]
    super_scales: torch.Tensor  # float16 [panels, K / 256, PANEL_ROWS]
    mins: torch.Tensor | None  # float32 [panels, K / 32, PANEL_ROWS]
    out_features: int

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """values, sub_scales, super_scales and mins (None: none), as the native kernel takes
        them."""
        return self.values, self.sub_scales, self.super_scales, self.mins


def _by_panel(per_group: torch.Tensor) -> torch.Tensor:
    """[N, groups] -> [panels, groups, PANEL_ROWS], rows zero-padded to whole panels."""
    padded = F.pad(per_group, (0, 0, 0, -per_group.shape[0] % PANEL_ROWS))
    return padded.view(-1, PANEL_ROWS, per_group.shape[1]).transpose(1, 2).contiguous()


def pack_q6_k_panels(
    qweight: torch.Tensor,
    sub_scales: torch.Tensor,
    super_scales: torch.Tensor,
    mins: torch.Tensor | None = None,
) -> Q6KPanels:
    values = pack_int8_panels(qweight, sub_scales[:, :1]).values
    return Q6KPanels(
        values,
        _by_panel(sub_scales),
        _by_panel(super_scales),
        None if mins is None else _by_panel(mins),
        qweight.shape[0],
    )


def dequantize_q6_k_reference(
    qweight: torch.Tensor,
    sub_scales: torch.Tensor,
    super_scales: torch.Tensor,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 weight [N, K]: d * s rounded to fp32 once, times q, plus the min, as
    `gguf.quants` computes Q6_K (and, min = -(dmin * m), Q4_K and Q5_K)."""
    per_super = super_scales.float().repeat_interleave(Q6_K_SUPER_BLOCK // Q6_K_SUB_BLOCK, dim=1)
    scales = per_super * sub_scales.float()
    values = qweight.float() * scales.repeat_interleave(Q6_K_SUB_BLOCK, dim=1)
    if mins is not None:
        values = values + mins.float().repeat_interleave(QUANT_BLOCK, dim=1)
    return values


def q6_k_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    sub_scales: torch.Tensor,
    super_scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    panels: Q6KPanels | None = None,
) -> torch.Tensor:
    dense = dequantize_q6_k_reference(qweight, sub_scales, super_scales, mins)
    x = kernel_activations(x, INT8_WEIGHT_ACTIVATION_BITS)
    return F.linear(x, dense.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _q6_k_linear_fits(
    x: torch.Tensor,
    qweight: torch.Tensor,
    sub_scales: torch.Tensor,
    super_scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    panels: Q6KPanels | None = None,
) -> bool:
    return quantized_fits(x, bias)


@native_or(q6_k_linear_reference, _q6_k_linear_fits)
def q6_k_linear(
    native: ModuleType,
    x: torch.Tensor,
    qweight: torch.Tensor,
    sub_scales: torch.Tensor,
    super_scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    panels: Q6KPanels | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the Q6_K weight w = (qweight, sub_scales, super_scales,
    mins); x: [..., K]. Up to QUANT_KERNEL_MAX_ROWS rows of x: the panel kernel on `panels`
    (packed here when not given); wider: torch's GEMM on the weight dequantized a tile at a
    time."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.shape[0] > QUANT_KERNEL_MAX_ROWS:
        weight = (qweight, sub_scales, super_scales, mins)
        rows = lambda part: dequantize_q6_k_reference(  # noqa: E731
            *(None if t is None else t[part] for t in weight)
        )
        return tiled_dequantized_linear(flat, x.shape, qweight.shape[0], rows, bias)
    if panels is None:
        panels = pack_q6_k_panels(qweight, sub_scales, super_scales, mins)
    out = native.q6_k_linear(flat, *panels.tensors(), panels.out_features, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


def _q6_k_kernel_fits(panels: Q6KPanels | None, bias: torch.Tensor | None) -> bool:
    return panels is not None and (bias is None or bias.dtype == torch.float32)


@native_or(no_native_kernel, _q6_k_kernel_fits)
def q6_k_linear_kernel(
    native: ModuleType, panels: Q6KPanels | None, bias: torch.Tensor | None
) -> object | None:
    """The native decode loop's handle on a Q6_K linear, from its `pack_q6_k_panels` form."""
    return native.LinearKernel.q6_k(*panels.tensors(), panels.out_features, bias)
