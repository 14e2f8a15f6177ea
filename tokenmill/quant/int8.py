"""int8 weight-only quantization, symmetric: w = scale * q with q in [-127, 127].

Per output channel (one fp32 scale per row: `group_size=None`, the int8 method's default) or
per group of inputs (one fp16 scale per row and group; groups of 32 are GGUF's Q8_0 blocks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.model.layers import Linear
from tokenmill.quant.linear import (
    QUANT_BLOCK,
    QUANTIZE_CHUNK_ROWS,
    PanelQuantLinear,
    check_group_size,
    frozen,
    num_groups,
    register_quant_linear,
)
from tokenmill.quant.method import QuantMethod, check_bits

INT8_MAX = 127


def int8_row_bytes(in_features: int) -> int:
    """A packed row pads its inputs to whole blocks of 32."""
    return num_groups(in_features, QUANT_BLOCK) * QUANT_BLOCK


@register_quant_linear
class Int8Linear(PanelQuantLinear):
    kind = "int8"

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group_size: int | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.group_size = None if group_size is None else check_group_size(group_size)
        row_bytes = int8_row_bytes(in_features)
        # The kernels see per-channel scales as a single group spanning the whole row.
        self.kernel_group_size = row_bytes if group_size is None else group_size
        scale_dtype = torch.float32 if group_size is None else torch.float16
        groups = num_groups(in_features, self.kernel_group_size)
        self.qweight = frozen(torch.zeros(out_features, row_bytes, dtype=torch.int8))
        self.scales = frozen(torch.zeros(out_features, groups, dtype=scale_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_linear(
            x, self.qweight, self.scales, self.kernel_group_size, self.bias, self.panels()
        )

    def panels(self) -> ops.QuantPanels | None:
        return self._panels.get(
            (self.qweight, self.scales), lambda: ops.pack_int8_panels(self.qweight, self.scales)
        )

    def native_kernel(self) -> object | None:
        return ops.int8_linear_kernel(self.panels(), self.kernel_group_size, self.bias)

    def dequantize(self) -> torch.Tensor:
        return ops.dequantize_int8(
            self.qweight, self.scales, self.kernel_group_size, self.in_features
        )

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int | None = None
    ) -> Int8Linear:
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, group_size)
        with torch.no_grad():
            for start in range(0, weight.shape[0], QUANTIZE_CHUNK_ROWS):
                rows = slice(start, start + QUANTIZE_CHUNK_ROWS)
                quantize_int8_into(
                    weight[rows], layer.qweight[rows], layer.scales[rows], layer.kernel_group_size
                )
            if bias is not None:
                layer.bias.copy_(bias)
        return layer


def quantize_int8_into(
    weight: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> None:
    """Round-to-nearest int8 of `weight` [N, K] into a layer's qweight and scales; the scale of a
    group is max|w| / 127, rounded to the scales' dtype before the weights are divided by it."""
    w = weight.detach().float()
    rows, k = w.shape
    groups = F.pad(w, (0, scales.shape[1] * group_size - k)).view(rows, scales.shape[1], -1)
    scales.copy_(groups.abs().amax(dim=-1) / INT8_MAX)
    step = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    q = torch.where(step > 0, w / step, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX)
    qweight.zero_()
    qweight[:, :k] = q.to(torch.int8)


class Int8Method(QuantMethod):
    """Every linear, LM head included, rounded to int8 from its float weight at load time."""

    name = "int8"

    def __init__(self, group_size: int | None = None, bits: int = 8) -> None:
        check_bits(self.name, bits, (8,))
        self.group_size = None if group_size is None else check_group_size(group_size)

    def quantize_linear(self, name: str, linear: Linear) -> Int8Linear:
        return Int8Linear.from_float(linear.weight, linear.bias, self.group_size)

    def options(self) -> dict[str, Any]:
        return {"bits": 8, "group_size": self.group_size}
