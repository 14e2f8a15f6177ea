"""GGUF's Q5_0 blocks held at their own 5.5 bits a weight: w = d * (q - 16), q in 0..31, one fp16
scale d per block of 32 inputs.

`Q50Linear` keeps the low 4 bits of the codes in int4's packed layout (`qweight`), each block's
fifth bits as the file stores them (`qhigh`: GGUF's little-endian 32 bits, bit j for input j)
and d (`scales`); its kernel (tokenmill.kernels.quant_linear, `q5_0_linear`) multiplies them
against x rounded to int8 blocks, as the int4 kernel does. Holding Q5_0 as int8 instead costs
8.5 bits a weight.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.kernels import ops
from tokenmill.quant.int4 import int4_row_bytes
from tokenmill.quant.linear import (
    QUANT_BLOCK,
    PanelQuantLinear,
    frozen,
    num_groups,
    register_quant_linear,
)


@register_quant_linear
class Q50Linear(PanelQuantLinear):
    kind = "q5_0"
    group_size = ops.Q5_0_GROUP

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        blocks = num_groups(in_features, QUANT_BLOCK)
        self.qweight = frozen(
            torch.zeros(out_features, int4_row_bytes(in_features), dtype=torch.uint8)
        )
        self.qhigh = frozen(torch.zeros(out_features, blocks * 4, dtype=torch.uint8))
        self.scales = frozen(torch.zeros(out_features, blocks, dtype=torch.float16))

    def _weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qweight, self.qhigh, self.scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.q5_0_linear(x, *self._weight(), self.bias, self.panels())

    def panels(self) -> ops.QuantPanels | None:
        return self._panels.get(
            self._weight(), lambda: ops.pack_q5_0_panels(*self._weight(), self.in_features)
        )

    def native_kernel(self) -> object | None:
        return ops.q5_0_linear_kernel(self.panels(), self.bias)

    def dequantize(self) -> torch.Tensor:
        return ops.dequantize_q5_0(*self._weight(), self.in_features)

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind}
