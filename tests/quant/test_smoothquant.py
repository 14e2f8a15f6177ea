"""SmoothQuant W8A8: smoothing factors, per-token activations, the integer GEMM paths."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.quant import smoothquant
from tokenmill.quant.smoothquant import (
    SmoothQuantLinear,
    int8_gemm_reference,
    quantize_tokens,
    smoothing_scales,
)


def test_smoothing_balances_activation_and_weight_ranges():
    activation_absmax = torch.tensor([100.0, 1.0, 4.0])
    weight_absmax = torch.tensor([1.0, 1.0, 0.25])
    scales = smoothing_scales(activation_absmax, weight_absmax, alpha=0.5)
    torch.testing.assert_close(scales, torch.tensor([10.0, 1.0, 4.0]))
    # After migration both sides share the same range per channel: sqrt(max|x| * max|w|).
    torch.testing.assert_close(activation_absmax / scales, weight_absmax * scales)


def test_tokens_round_trip_within_half_a_step():
    x = torch.randn(40, 300, generator=torch.Generator().manual_seed(0)) * 3
    x[:, 7] += 50  # an outlier channel
    codes, scales, zeros = quantize_tokens(x)
    assert codes.dtype == torch.uint8 and scales.shape == zeros.shape == (40,)
    restored = (codes.float() - zeros[:, None]) * scales[:, None]
    assert ((restored - x).abs() <= scales[:, None] / 2 + 1e-5).all()


def test_onednn_int8_gemm_equals_integer_arithmetic():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 96, generator=gen)
    layer = SmoothQuantLinear.from_smoothed(weight)
    assert int(layer.qweight.abs().max()) <= smoothquant.WEIGHT_MAX_CODE
    x = torch.randn(40, 96, generator=gen)
    codes, scales, zeros = quantize_tokens(x)
    weight_codes = layer.qweight
    exact = (codes.int() - zeros[:, None].int()) @ weight_codes.int().T
    expected = exact.float() * scales[:, None] * layer.scales.view(1, -1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.dequantize(), weight_codes.float() * layer.scales[:, None])
    torch.testing.assert_close(
        int8_gemm_reference(codes, weight_codes), (codes.int() @ weight_codes.int().T).float()
    )


@pytest.mark.parametrize("rows", [1, 16, 33, 200])
def test_linear_stays_close_to_the_float_product(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(130, 200, generator=gen), torch.randn(130, generator=gen)
    layer = SmoothQuantLinear.from_smoothed(weight, bias)
    x = torch.randn(rows, 200, generator=gen)
    out, reference = layer(x), F.linear(x, weight, bias)
    assert out.shape == (rows, 130)
    assert ((out - reference).norm() / reference.norm()).item() < 0.03


@pytest.mark.parametrize("rows", [1, 40])
def test_without_onednn_the_reference_gives_the_same_result(monkeypatch, rows):
    gen = torch.Generator().manual_seed(2)
    layer = SmoothQuantLinear.from_smoothed(torch.randn(50, 64, generator=gen))
    x = torch.randn(rows, 64, generator=gen)
    with_onednn = layer(x)
    monkeypatch.setattr(smoothquant, "_HAS_ONEDNN", False)
    layer._gemm = None
    torch.testing.assert_close(layer(x), with_onednn, rtol=1e-5, atol=1e-4)


def test_reloaded_codes_are_repacked():
    gen = torch.Generator().manual_seed(3)
    first = SmoothQuantLinear.from_smoothed(torch.randn(40, 64, generator=gen))
    second = SmoothQuantLinear.from_smoothed(torch.randn(40, 64, generator=gen))
    x = torch.randn(50, 64, generator=gen)
    first(x)  # packs the first codes
    with torch.no_grad():
        first.qweight.copy_(second.qweight)
        first.scales.copy_(second.scales)
    torch.testing.assert_close(first(x), second(x))
