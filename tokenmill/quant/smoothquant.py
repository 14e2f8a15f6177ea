"""SmoothQuant W8A8 (Xiao et al., 2022): int8 weights, int8 activations, integer products.

Activations are hard to quantize per token because a few channels run 10-100x larger than the
rest; weights are easy. Dividing input channel j by s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)
and multiplying the weights' column j by it (folded into the norm or linear in front, see
`smoothing.py`) moves part of that difficulty into the weights; alpha = 0.5 splits it evenly.

Weights are then int8 per output channel, activations int8 per token, quantized on every call.
Decode rows (up to `ops.W8A8_PANEL_MAX_ROWS`) run int8's panel kernel on a panel copy of the
codes, in the native decode loop too; wider inputs run native per-token quantization, oneDNN's
int8 GEMM and a native rescale (kernels/w8a8_linear.py has both routes and their rounding).
`TOKENMILL_W8A8=reference` keeps the baseline: every product through the torch reference
(per-token quantization in torch ops, the same oneDNN GEMM) and no decode loop.

AVX2 has no int8 x int8 dot product: oneDNN multiplies unsigned by signed bytes and adds pairs
of products in int16, which saturates when both sides use 8 bits. So activations take the
unsigned side with all 8 bits (asymmetric per token: x ~ (q - zero) * scale, q in 0..255) and
weights give up one bit (symmetric, -63..63): a pair stays below 2 * 255 * 63 < 2^15.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.quant.calibrated import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_CALIB_SEQ_LEN,
    CalibratedMethod,
)
from tokenmill.quant.layerwise import LAYER_LINEARS, LayerInputs, replace_module
from tokenmill.quant.linear import (
    QUANT_BLOCK,
    DerivedCache,
    PanelCache,
    QuantLinear,
    frozen,
    num_groups,
    register_quant_linear,
)
from tokenmill.quant.method import check_bits
from tokenmill.quant.smoothing import Migration, llama_migrations, untie_lm_head

DEFAULT_ALPHA = 0.5
WEIGHT_MAX_CODE = 63  # 7 bits: see the module docstring
# "reference" runs every W8A8 product through the torch reference and keeps the layers out of the
# native decode loop: the baseline the native paths are measured against.
W8A8_ENV = "TOKENMILL_W8A8"


def smoothing_scales(
    activation_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max|w_j|^(1 - alpha) per input channel j."""
    scales = activation_absmax.clamp(min=1e-5).pow(alpha) / weight_absmax.clamp(min=1e-5).pow(
        1 - alpha
    )
    return scales.clamp(min=1e-5)


def reference_requested() -> bool:
    """Whether the environment asks for the baseline (`TOKENMILL_W8A8=reference`)."""
    return os.environ.get(W8A8_ENV, "native").strip().lower() == "reference"


@register_quant_linear
class SmoothQuantLinear(QuantLinear):
    """w = scale * q per output row, q in -63..63; x quantized per token on every call."""

    kind = "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.qweight = frozen(torch.zeros(out_features, in_features, dtype=torch.int8))
        self.scales = frozen(torch.zeros(out_features))
        # The panel kernel sees the per-row scale as one group spanning the padded row.
        self.kernel_group_size = num_groups(in_features, QUANT_BLOCK) * QUANT_BLOCK
        self.reference = reference_requested()  # the switch's baseline, read when built
        self._gemm = DerivedCache()  # oneDNN's copy of the codes and the scaled row sums
        self._panels = PanelCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"SmoothQuantLinear: x must be [..., {self.in_features}], got {list(x.shape)}"
            )
        rows = x.numel() // self.in_features
        if not self.reference and 0 < rows <= ops.W8A8_PANEL_MAX_ROWS:
            return ops.w8a8_panel_linear(
                x,
                self.qweight,
                self.scales[:, None],
                self.kernel_group_size,
                self.bias,
                self.panels(),
            )
        onednn, scaled_row_sums = self._packed()
        product = ops.w8a8_linear_reference if self.reference else ops.w8a8_linear
        return product(x, self.qweight, self.scales, scaled_row_sums, onednn, self.bias)

    def panels(self) -> ops.QuantPanels | None:
        """The codes as int8 panels (one more byte a weight) for the decode rows' kernel; None
        under torch's kernels."""
        return self._panels.get((self.qweight, self.scales), self._pack_panels)

    def _pack_panels(self) -> ops.QuantPanels:
        padded = F.pad(self.qweight, (0, self.kernel_group_size - self.in_features))
        return ops.pack_int8_panels(padded, self.scales[:, None].contiguous())

    def native_kernel(self) -> object | None:
        if self.reference:
            return None
        return ops.w8a8_linear_kernel(self.panels(), self.kernel_group_size, self.bias)

    def prepare(self) -> None:
        self._packed()
        if not self.reference:
            self.panels()

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def _packed(self) -> tuple[ops.OneDNNWeight | None, torch.Tensor]:
        """oneDNN's copy of the weight codes (None without oneDNN) and each row's code sum
        times its scale, rebuilt whenever those change (a checkpoint loading into them)."""
        return self._gemm.get((self.qweight, self.scales), self._make_gemm)

    def _make_gemm(self) -> tuple[ops.OneDNNWeight | None, torch.Tensor]:
        row_sums = self.qweight.sum(dim=1, dtype=torch.int32).float() * self.scales
        onednn = ops.OneDNNWeight(self.qweight) if ops.ONEDNN_AVAILABLE else None
        return onednn, row_sums

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
