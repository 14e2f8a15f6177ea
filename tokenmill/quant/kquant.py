"""Linears holding GGUF k-quant super-blocks (256 inputs) exactly, on native kernels.

Q4_K (fp16 d and dmin, eight 6-bit scales s and mins m, 4-bit q; w = d*s * q - dmin*m per 32)
  -> `Q4KLinear`: int4 in groups of 32 whose scale d*s and min -(dmin*m) are fp32, the values
     each product rounds to, so the int4 kernels run it unchanged and it dequantizes to the
     same bits. (fp16 would not hold d*s exactly.)
Q6_K (fp16 d, sixteen int8 scales s, 6-bit q; w = d*s * (q - 32) per 16)
  -> `Q6KLinear`: the codes q - 32 as int8 with s and d as they are, on its own kernel
     (tokenmill.kernels.kquant_linear), as the int8 kernels' groups are whole blocks of 32.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.kernels import ops
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.linear import PanelQuantLinear, frozen, register_quant_linear

K_SUPER_BLOCK = 256
Q4_K_GROUP = 32


def check_super_blocks(kind: str, in_features: int) -> None:
    if in_features % K_SUPER_BLOCK:
        raise ValueError(
            f"{kind} weights come in super-blocks of 256 inputs, got in_features={in_features}"
        )


@register_quant_linear
class Q4KLinear(Int4Linear):
    """Int4 in groups of 32 with fp32 scales and mins: a Q4_K tensor without loss."""

    kind = "q4_k"
    scale_dtype = torch.float32

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        check_super_blocks(self.kind, in_features)
        super().__init__(in_features, out_features, bias, Q4_K_GROUP)

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind}


@register_quant_linear
class Q6KLinear(PanelQuantLinear):
    """Int8 codes -32..31 with an int8 scale per 16 inputs and an fp16 scale per 256."""

    kind = "q6_k"
    group_size = None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        check_super_blocks(self.kind, in_features)
        super().__init__(in_features, out_features, bias)
        self.qweight = frozen(torch.zeros(out_features, in_features, dtype=torch.int8))
        self.sub_scales = frozen(
            torch.zeros(out_features, in_features // ops.Q6_K_SUB_BLOCK, dtype=torch.int8)
        )
        self.super_scales = frozen(
            torch.zeros(out_features, in_features // K_SUPER_BLOCK, dtype=torch.float16)
        )

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.qweight, self.sub_scales, self.super_scales

    def _weight(self) -> tuple[torch.Tensor | None, ...]:
        """(qweight, sub_scales, super_scales, mins or None), as the Q6_K ops take them."""
        tensors = self._tensors()
        return tensors if len(tensors) == 4 else (*tensors, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.q6_k_linear(x, *self._weight(), self.bias, self.panels())

    def panels(self) -> ops.Q6KPanels | None:
        return self._panels.get(self._tensors(), lambda: ops.pack_q6_k_panels(*self._weight()))

    def native_kernel(self) -> object | None:
        return ops.q6_k_linear_kernel(self.panels(), self.bias)

    def dequantize(self) -> torch.Tensor:
        return ops.dequantize_q6_k_reference(*self._weight())

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind}


@register_quant_linear
class Q5KLinear(Q6KLinear):
    """Q6KLinear's codes and scales plus an fp32 min per 32 inputs: w = d * s * q + min."""

    kind = "q5_k"

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.mins = frozen(torch.zeros(out_features, in_features // Q4_K_GROUP))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.qweight, self.sub_scales, self.super_scales, self.mins
