"""fp8 (e4m3) weights with one fp32 scale per output channel: 1 byte per weight, no outlier
handling needed (a float format keeps relative precision at every magnitude).

e4m3 has 3 mantissa bits and reaches +-448, so each row is scaled to put its largest |w| at 448.
CPUs here cannot multiply fp8, so each tile of rows is widened to fp32 just before its product
and dropped after; torch's own fp8->fp32 cast runs at ~0.1 G values/s here, so the widening goes
through fp16 by moving bits instead (16x faster; see `fp8_to_float`).
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
# fp16 holds e4m3's exponent and mantissa bits with 8 more exponent bias: widened values are
# the e4m3 values times 2^-8, which the row scales absorb.
_FP16_SHIFT_SCALE = 256.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes `[N, K]` and fp32 scales `[N]` with weight ~ codes * scales[:, None]."""
    scales = weight.abs().amax(dim=1).float().clamp(min=1e-12) / FP8_MAX
    codes = (weight.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def fp8_to_float(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes * scales[:, None] in fp32.

    e4m3 bits s eeee mmm, sign-extended to 16 bits and shifted left by 7, are fp16's
    s eeeee mmmmmmmmmm with a stray copy of s in the top exponent bit; clearing it leaves an
    fp16 equal to the e4m3 value times 2^-8, subnormals included (NaN codes never occur).
    """
    bits = (codes.view(torch.int8).to(torch.int16) << 7).bitwise_and_(~0x4000)
    return bits.view(torch.float16).float().mul_(scales[:, None] * _FP16_SHIFT_SCALE)


# Output rows widened to fp32 at a time: 256 rows of 1536 inputs are 1.5 MiB, L2-sized.
TILE_ROWS = 256


@register_quant_linear
class Fp8Linear(QuantLinear):
    kind = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.qweight = frozen(torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        self.scales = frozen(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.empty(flat.shape[0], self.out_features, dtype=x.dtype)
        for start in range(0, self.out_features, TILE_ROWS):
            rows = slice(start, start + TILE_ROWS)
            tile = fp8_to_float(self.qweight[rows], self.scales[rows]).to(x.dtype)
            bias = None if self.bias is None else self.bias[rows]
            out[:, rows] = ops.linear(flat, tile, bias)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return fp8_to_float(self.qweight, self.scales)

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
