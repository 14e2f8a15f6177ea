"""Products of a W8A8 (SmoothQuant) weight: int8 codes -63..63 with one scale per output row,
times activations quantized to 8 bits on every call. Two routes, by the rows of x:

- Up to W8A8_PANEL_MAX_ROWS rows (decode): the int8 panel kernel (`quant_linear`) on a panel copy
  of the codes, the row's scale as its one group's; the decode loop takes these layers too. It
  rounds x per block of 32 inputs, symmetric, to int16 (the int8 weights' kernel): a finer
  rounding than the wide route's 8 bits a token, not the same function.
- Wider (prefill, large batches): `w8a8_linear`, x's rows asymmetric over uint8 0..255 (native
  `quantize_tokens`, one pass), oneDNN's u8 x s8 GEMM (`torch.ops.onednn.qlinear_pointwise`, the
  fastest int8 GEMM torch ships for CPUs), then the zero points' share taken off and the token
  scales applied in one native pass over the output.

Asymmetric activations take the unsigned side at all 8 bits; the weights give up one bit so that
AVX2's int16 pair sums cannot saturate (2 * 255 * 63 < 2^15): see quant/smoothquant.py.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenmill.kernels.dispatch import native_or
from tokenmill.kernels.quant_linear import INT8, QuantPanels, _linear, quantized_fits

ACTIVATION_MAX_CODE = 255
# Rows of x up to which the panel kernel beats quantize + oneDNN GEMM + rescale over SmolLM2's
# four layer products (docs/quantization.md); at most quant_linear.QUANT_KERNEL_MAX_ROWS.
W8A8_PANEL_MAX_ROWS = 4
# The panel route's format: int8's kernels, named apart so the decode loop keeps it to
# W8A8_PANEL_MAX_ROWS rows and a profile labels it.
W8A8 = INT8._replace(kind="w8a8")

ONEDNN_AVAILABLE = (
    hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()
)


class OneDNNWeight:
    """oneDNN's packed copy of int8 weight codes [N, K], with the per-row zero points (all 0)
    that every call passes."""

    def __init__(self, qweight: torch.Tensor) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(qweight, None)
        self.zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)

    def product(self, codes: torch.Tensor, weight_scales: torch.Tensor) -> torch.Tensor:
        """fp32 `[T, N]`: uint8 codes [T, K] times the weight codes, column n times
        weight_scales[n]."""
        return torch.ops.onednn.qlinear_pointwise(
            codes,
            1.0,
            0,
            self.packed,
            weight_scales,
            self.zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )


def quantize_tokens_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-row uint8 codes, fp32 scales `[T]` and zero points `[T]` of x `[T, K]`:
    x ~ (codes - zeros) * scales, each row's range (widened to hold 0) spread over 0..255."""
    low = x.amin(dim=-1).clamp(max=0.0)
    high = x.amax(dim=-1).clamp(min=0.0)
    scales = ((high - low) / ACTIVATION_MAX_CODE).clamp(min=1e-12)
    zeros = (-low / scales).round()
    # Times the reciprocal (correctly rounded), not divided: a multiplication a value is faster
    # natively, and the native pass does exactly this.
    inverse = torch.reciprocal(scales)
    codes = torch.round(x * inverse[:, None]).add_(zeros[:, None]).clamp_(0, ACTIVATION_MAX_CODE)
    return codes.to(torch.uint8), scales, zeros


def _tokens_fit(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[1] > 0 and quantized_fits(x, None)


@native_or(quantize_tokens_reference, _tokens_fit)
def quantize_tokens(
    native: ModuleType, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_tokens_reference`, bit for bit, in one native pass over each row."""
    return native.quantize_tokens(x)


def int8_gemm_reference(codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """codes [T, K] uint8 times weight_codes [N, K] int8 transposed, as fp32 `[T, N]`: exact
    while the sums stay below 2^24."""
    return codes.float() @ weight_codes.float().T


def _check_x(x: torch.Tensor, qweight: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] != qweight.shape[1]:
        raise ValueError(
            f"w8a8_linear: x must be [..., {qweight.shape[1]}] for this weight, got {list(x.shape)}"
        )


def w8a8_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scales: torch.Tensor,
    scaled_row_sums: torch.Tensor,
    onednn: OneDNNWeight | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The product in torch operations: x's rows quantized (`quantize_tokens_reference`), the
    integer product (oneDNN's when `onednn` is given, else exact in fp32), then
    (sums - zero * scaled_row_sums) * scale + bias."""
    _check_x(x, qweight)
    codes, scales, zeros = quantize_tokens_reference(x.reshape(-1, x.shape[-1]).float())
    if onednn is None:
        sums = int8_gemm_reference(codes, qweight).mul_(weight_scales)
    else:
        sums = onednn.product(codes, weight_scales)
    out = sums.sub_(zeros[:, None] * scaled_row_sums).mul_(scales[:, None])
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], qweight.shape[0]).to(x.dtype)


def _w8a8_fits(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scales: torch.Tensor,
    scaled_row_sums: torch.Tensor,
    onednn: OneDNNWeight | None = None,
    bias: torch.Tensor | None = None,
) -> bool:
    return onednn is not None and x.dim() >= 1 and quantized_fits(x, bias)


@native_or(w8a8_linear_reference, _w8a8_fits)
def w8a8_linear(
    native: ModuleType,
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scales: torch.Tensor,
    scaled_row_sums: torch.Tensor,
    onednn: OneDNNWeight | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for w = weight_scales[:, None] * qweight, x quantized to uint8
    per token; `scaled_row_sums` is (qweight's row sums) * weight_scales, `onednn` the packed
    codes. Bit-identical to `w8a8_linear_reference` given the same `onednn`."""
    _check_x(x, qweight)
    codes, scales, zeros = native.quantize_tokens(x.reshape(-1, x.shape[-1]))
    out = onednn.product(codes, weight_scales)
    native.w8a8_rescale_(out, scales, zeros, scaled_row_sums, bias)
    return out.view(*x.shape[:-1], qweight.shape[0])


def w8a8_panel_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    """`quant_linear.int8_linear` on a W8A8 weight (scales [N, 1], group_size its padded row),
    under its own name: up to W8A8_PANEL_MAX_ROWS rows of x."""
    return _linear(W8A8, x, (qweight, scales), group_size, bias, panels)
