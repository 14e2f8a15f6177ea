"""SmoothQuant W8A8 (Xiao et al., 2022): int8 weights, int8 activations, integer products.

Activations are hard to quantize per token because a few channels run 10-100x larger than the
rest; weights are easy. Dividing input channel j by s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)
and multiplying the weights' column j by it (folded into the norm or linear in front, see
`smoothing.py`) moves part of that difficulty into the weights; alpha = 0.5 splits it evenly.

Weights are then int8 per output channel, activations int8 per token, quantized on every call,
and the product is one oneDNN int8 GEMM (`torch.ops.onednn.qlinear_pointwise`) whose int32 sums
are rescaled to fp32. `torch._int_mm` is correct on CPU but runs a plain loop here, far slower
than the fp32 GEMM. The int8 GEMM pays off on wide batches (prefill, many sequences), where
compute bounds the product; one row at a time it streams the weights well below memory
bandwidth, so single-stream decode is slower than the `int8` method's kernel
(docs/quantization.md has the figures).

AVX2 has no int8 x int8 dot product: oneDNN multiplies unsigned by signed bytes and adds pairs
of products in int16, which saturates when both sides use 8 bits. So activations take the
unsigned side with all 8 bits (asymmetric per token: x ~ (q - zero) * scale, q in 0..255) and
weights give up one bit (symmetric, -63..63): a pair stays below 2 * 255 * 63 < 2^15.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.quant.calibrated import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_CALIB_SEQ_LEN,
    CalibratedMethod,
)
from tokenmill.quant.layerwise import LAYER_LINEARS, LayerInputs, replace_module
from tokenmill.quant.linear import QuantLinear, frozen, register_quant_linear
from tokenmill.quant.method import check_bits
from tokenmill.quant.smoothing import Migration, llama_migrations, untie_lm_head

DEFAULT_ALPHA = 0.5
WEIGHT_MAX_CODE = 63  # 7 bits: see the module docstring
ACTIVATION_MAX_CODE = 255


def smoothing_scales(
    activation_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max|w_j|^(1 - alpha) per input channel j."""
    scales = activation_absmax.clamp(min=1e-5).pow(alpha) / weight_absmax.clamp(min=1e-5).pow(
        1 - alpha
    )
    return scales.clamp(min=1e-5)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-row uint8 codes, fp32 scales `[T]` and zero points `[T]` of x `[T, K]`:
    x ~ (codes - zeros) * scales, each row's range (widened to hold 0) spread over 0..255."""
    low = x.amin(dim=-1).clamp(max=0.0)
    high = x.amax(dim=-1).clamp(min=0.0)
    scales = ((high - low) / ACTIVATION_MAX_CODE).clamp(min=1e-12)
    zeros = (-low / scales).round()
    codes = torch.round(x / scales[:, None]).add_(zeros[:, None]).clamp_(0, ACTIVATION_MAX_CODE)
    return codes.to(torch.uint8), scales, zeros


def int8_gemm_reference(codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """codes [T, K] uint8 times weight_codes [N, K] int8 transposed, as fp32 `[T, N]`: exact
    while the sums stay below 2^24."""
    return codes.float() @ weight_codes.float().T


@register_quant_linear
class SmoothQuantLinear(QuantLinear):
    """w = scale * q per output row, q in -63..63; x quantized per token on every call."""

    kind = "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.qweight = frozen(torch.zeros(out_features, in_features, dtype=torch.int8))
        self.scales = frozen(torch.zeros(out_features))
        self._gemm: tuple[tuple[int, int], torch.Tensor | None, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes, scales, zeros = quantize_tokens(x.reshape(-1, self.in_features).float())
        packed, scaled_row_sums = self._packed()
        if packed is None:
            sums = int8_gemm_reference(codes, self.qweight).mul_(self.scales)
        else:
            sums = _onednn_int8_gemm(codes, packed, self.scales)
        out = sums.sub_(zeros[:, None] * scaled_row_sums).mul_(scales[:, None])
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def _packed(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """oneDNN's copy of the weight codes (None without oneDNN) and each row's code sum
        times its scale, rebuilt whenever those change (a checkpoint loading into them)."""
        version = (self.qweight._version, self.scales._version)
        if self._gemm is None or self._gemm[0] != version:
            row_sums = self.qweight.sum(dim=1, dtype=torch.int32).float() * self.scales
            packed = torch.ops.onednn.qlinear_prepack(self.qweight, None) if _HAS_ONEDNN else None
            self._gemm = (version, packed, row_sums)
        return self._gemm[1], self._gemm[2]

    @classmethod
    def from_smoothed(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> SmoothQuantLinear:
        """Symmetric per-channel 7-bit codes of an already smoothed weight."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None)
        w = weight.detach().float()
        scales = w.abs().amax(dim=1) / WEIGHT_MAX_CODE
        steps = torch.where(scales[:, None] > 0, w / scales[:, None], torch.zeros_like(w))
        with torch.no_grad():
            layer.qweight.copy_(steps.round().clamp(-WEIGHT_MAX_CODE, WEIGHT_MAX_CODE))
            layer.scales.copy_(scales)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer


_HAS_ONEDNN = (
    hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()
)


def _onednn_int8_gemm(
    codes: torch.Tensor, packed: torch.Tensor, weight_scales: torch.Tensor
) -> torch.Tensor:
    """fp32 `[T, N]`: codes times the packed weight codes, column n times weight_scales[n]."""
    zero_points = torch.zeros(weight_scales.shape[0], dtype=torch.long)
    return torch.ops.onednn.qlinear_pointwise(
        codes,
        1.0,
        0,
        packed,
        weight_scales,
        zero_points,
        None,
        1.0,
        0,
        torch.float32,
        "none",
        [],
        "",
    )


class AbsMax:
    """Largest |x| per input channel over all calibration rows."""

    def __init__(self, in_features: int) -> None:
        self.values = torch.zeros(in_features)

    def add(self, x: torch.Tensor) -> None:
        torch.maximum(self.values, x.abs().amax(dim=0).float(), out=self.values)


def smoothquant_model(model: nn.Module, samples: torch.Tensor, alpha: float) -> None:
    """Smooth and quantize every linear of `model` to W8A8, in place, the LM head included."""
    migrations = llama_migrations(model.config)
    inputs = LayerInputs(model, samples)
    for layer in model.layers:
        seen = {name: AbsMax(layer.get_submodule(name).in_features) for name in LAYER_LINEARS}
        inputs.advance(layer, {name: stat.add for name, stat in seen.items()})
        _smooth_and_quantize(layer, migrations, seen, alpha)
    untie_lm_head(model)
    head = AbsMax(model.config.hidden_size)
    head.add(inputs.final_hidden(model.norm))
    _smooth_and_quantize(model, [Migration("lm_head", "norm")], {"lm_head": head}, alpha)


def _smooth_and_quantize(
    block: nn.Module, migrations: list[Migration], seen: dict[str, AbsMax], alpha: float
) -> None:
    with torch.no_grad():
        for m in migrations:
            weight = block.get_submodule(m.linear).weight
            scales = smoothing_scales(
                m.reduce(seen[m.linear].values, largest=True),
                m.reduce(weight.abs().amax(dim=0), largest=True),
                alpha,
            )
            m.apply(block, scales)
        for m in migrations:
            linear = block.get_submodule(m.linear)
            replace_module(
                block, m.linear, SmoothQuantLinear.from_smoothed(linear.weight, linear.bias)
            )


class SmoothQuantMethod(CalibratedMethod):
    """Every linear, LM head included, smoothed and quantized to W8A8 at load time."""

    name = "smoothquant"

    def __init__(
        self,
        alpha: float = DEFAULT_ALPHA,
        bits: int = 8,
        calib_samples: int = DEFAULT_CALIB_SAMPLES,
        calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN,
    ) -> None:
        super().__init__(calib_samples, calib_seq_len)
        check_bits(self.name, bits, (8,))
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)

    def calibrate(self, model: nn.Module, samples: torch.Tensor) -> None:
        smoothquant_model(model, samples, self.alpha)

    def options(self) -> dict[str, Any]:
        return {"bits": 8, "alpha": self.alpha, **super().options()}
