"""int4 weight-only quantization, group-wise asymmetric: w = scale * q + min with q in 0..15,
one fp16 scale and one fp16 min per output row and group of `group_size` inputs.

Two codes per byte in the kernels' layout (each 64 inputs take 32 bytes: input i in the low
nibble of byte i, input 32 + i in the high one). GGUF's Q4_1 blocks are exactly groups of 32
with fp16 scale and min, and Q4_0's are too with min = -8 * scale (tokenmill.quant.gguf). GPTQ
and AWQ end in the same format: with zero points z, pass `mins = -z * scales` to `from_codes`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.model.layers import Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import (
    LM_HEAD,
    QUANT_BLOCK,
    QUANTIZE_CHUNK_ROWS,
    PanelQuantLinear,
    QuantLinear,
    check_group_size,
    frozen,
    num_groups,
    register_quant_linear,
)
from tokenmill.quant.method import QuantMethod, check_bits

INT4_MAX = 15
DEFAULT_GROUP_SIZE = 32
UNIT_INPUTS = 2 * QUANT_BLOCK  # inputs per 32 packed bytes


def int4_row_bytes(in_features: int) -> int:
    """A packed row pads its inputs to whole units of 64, 32 bytes each."""
    return num_groups(in_features, UNIT_INPUTS) * QUANT_BLOCK


@register_quant_linear
class Int4Linear(PanelQuantLinear):
    kind = "int4"
    scale_dtype = torch.float16

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.group_size = check_group_size(group_size)
        groups = num_groups(in_features, group_size)
        row_bytes = int4_row_bytes(in_features)
        self.qweight = frozen(torch.zeros(out_features, row_bytes, dtype=torch.uint8))
        self.scales = frozen(torch.zeros(out_features, groups, dtype=self.scale_dtype))
        self.mins = frozen(torch.zeros(out_features, groups, dtype=self.scale_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int4_linear(
            x, self.qweight, self.scales, self.mins, self.group_size, self.bias, self.panels()
        )

    def panels(self) -> ops.QuantPanels | None:
        return self._panels.get(
            (self.qweight, self.scales, self.mins),
            lambda: ops.pack_int4_panels(self.qweight, self.scales, self.mins, self.in_features),
        )

    def native_kernel(self) -> object | None:
        return ops.int4_linear_kernel(self.panels(), self.group_size, self.bias)

    def dequantize(self) -> torch.Tensor:
        return ops.dequantize_int4(
            self.qweight, self.scales, self.mins, self.group_size, self.in_features
        )

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """A layer from codes (uint8 0..15, [N, K]) and per-group scales and mins [N, groups]."""
        layer = cls(codes.shape[1], codes.shape[0], bias is not None, group_size)
        if scales.shape != layer.scales.shape or mins.shape != layer.mins.shape:
            raise ValueError(
                f"scales and mins must be {tuple(layer.scales.shape)} for codes of shape "
                f"{tuple(codes.shape)} in groups of {group_size}, got {tuple(scales.shape)} "
                f"and {tuple(mins.shape)}"
            )
        with torch.no_grad():
            layer.qweight.copy_(pack_int4(codes))
            layer.scales.copy_(scales)
            layer.mins.copy_(mins)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> Int4Linear:
        """Round-to-nearest: each group's minimum and maximum map to codes 0 and 15."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, group_size)
        with torch.no_grad():
            for start in range(0, weight.shape[0], QUANTIZE_CHUNK_ROWS):
                rows = slice(start, start + QUANTIZE_CHUNK_ROWS)
                codes, scales, mins = quantize_int4(weight[rows], group_size)
                layer.qweight[rows] = pack_int4(codes)
                layer.scales[rows] = scales
                layer.mins[rows] = mins
            if bias is not None:
                layer.bias.copy_(bias)
        return layer


def quantize_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K], fp16 scales and mins [N, groups] of `weight` [N, K], rounding to nearest.
    Scale and min are rounded to fp16 before the codes are chosen against them."""
    w = weight.detach().float()
    rows, k = w.shape
    groups = num_groups(k, group_size)
    # A short last group is padded with copies of the row's last input: its range stays put.
    padded = F.pad(w[None], (0, groups * group_size - k), mode="replicate")[0]
    grouped = padded.view(rows, groups, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales, mins = ((high - low) / INT4_MAX).half(), low.half()
    step = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    offset = mins.float().repeat_interleave(group_size, dim=1)[:, :k]
    codes = torch.where(step > 0, (w - offset) / step, 0.0).round_().clamp_(0, INT4_MAX)
    return codes.to(torch.uint8), scales, mins


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [N, K] -> the kernels' packed layout [N, int4_row_bytes(K)];
    `ops.unpack_int4` is the inverse."""
    rows, k = codes.shape
    padded = F.pad(codes, (0, num_groups(k, UNIT_INPUTS) * UNIT_INPUTS - k))
    units = padded.view(rows, -1, 2, QUANT_BLOCK)
    return (units[:, :, 0] | (units[:, :, 1] << 4)).reshape(rows, -1)


class Int4Method(QuantMethod):
    """Every linear rounded to group-wise int4 from its float weight at load time, but the LM
    head, which gets int8 in groups of 32."""

    name = "int4"

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, bits: int = 4) -> None:
        check_bits(self.name, bits, (4,))
        self.group_size = check_group_size(group_size)

    def quantize_linear(self, name: str, linear: Linear) -> QuantLinear:
        if name == LM_HEAD:
            # As llama.cpp keeps its output tensor wider: an int4 head costs SmolLM2 about 30x
            # the KL divergence of an int8 one (docs/quantization.md).
            return Int8Linear.from_float(linear.weight, linear.bias, group_size=QUANT_BLOCK)
        return Int4Linear.from_float(linear.weight, linear.bias, self.group_size)

    def options(self) -> dict[str, Any]:
        return {"bits": 4, "group_size": self.group_size}
