"""fp8 (e4m3) weights with one fp32 scale per output channel: 1 byte per weight, no outlier
handling needed (a float format keeps relative precision at every magnitude).

e4m3 has 3 mantissa bits and reaches +-448, so each row is scaled to put its largest |w| at 448.
CPUs here cannot multiply fp8: the native kernel decodes the codes to fp32 in registers as it
loads them (`ops.fp8_linear`), so DRAM streams one byte per weight, as for int8.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.kernels import ops
from tokenmill.model.layers import Linear
from tokenmill.quant.linear import QuantLinear, frozen, register_quant_linear
from tokenmill.quant.method import QuantMethod, check_bits

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes `[N, K]` and fp32 scales `[N]` with weight ~ codes * scales[:, None]."""
    scales = weight.abs().amax(dim=1).float().clamp(min=1e-12) / FP8_MAX
    codes = (weight.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


@register_quant_linear
class Fp8Linear(QuantLinear):
    kind = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.qweight = frozen(torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        self.scales = frozen(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, self.qweight, self.scales, self.bias)

    def native_kernel(self) -> object | None:
        return ops.fp8_linear_kernel(self.qweight, self.scales, self.bias)

    def dequantize(self) -> torch.Tensor:
        return ops.dequantize_fp8(self.qweight, self.scales)

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        layer = cls(weight.shape[1], weight.shape[0], bias is not None)
        with torch.no_grad():
            codes, scales = quantize_fp8(weight.detach())
            layer.qweight.copy_(codes)
            layer.scales.copy_(scales)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer


class Fp8Method(QuantMethod):
    """Every linear, LM head included, rounded to e4m3 with per-channel scales at load time."""

    name = "fp8"

    def __init__(self, bits: int = 8) -> None:
        check_bits(self.name, bits, (8,))

    def quantize_linear(self, name: str, linear: Linear) -> Fp8Linear:
        return Fp8Linear.from_float(linear.weight, linear.bias)

    def options(self) -> dict[str, Any]:
        return {"bits": 8}
