"""GPTQ on synthetic layers: lower output error than round-to-nearest, same stored format."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant.gptq import HessianAccumulator, gptq_quantize
from tokenmill.quant.groupwise import Int4Codes, quantize_clipped, search_clip


def correlated_inputs(rows: int, features: int, seed: int = 0) -> torch.Tensor:
    """Activations like a transformer's: low-rank correlated, a few channels 10x larger."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32, generator=gen) @ torch.randn(32, features, generator=gen)
    x += 0.3 * torch.randn(rows, features, generator=gen)
    x[:, :4] *= 10
    return x


def output_error(x: torch.Tensor, weight: torch.Tensor, quantized: torch.Tensor) -> float:
    return (x @ quantized.T - x @ weight.T).pow(2).mean().item()


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    for part in x.split(500):
        acc.add(part)
    return acc.hessian()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_far_below_round_to_nearest(act_order):
    x = correlated_inputs(2048, 256)
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    gptq = gptq_quantize(weight, hessian_of(x), group_size=64, act_order=act_order)
    rtn = Int4Codes.round_to_nearest(weight, group_size=64)
    assert output_error(x, weight, gptq.dequantize()) < 0.2 * output_error(
        x, weight, rtn.dequantize()
    )


@pytest.mark.parametrize("act_order", [False, True])
def test_uncorrelated_inputs_give_plain_rounding_in_the_searched_ranges(act_order):
    """With H = c I no column's error can be absorbed by another: GPTQ must reduce to rounding
    each group to nearest within the range the clip search picks."""
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(2))
    hessian = 2 * torch.eye(96)
    gptq = gptq_quantize(weight, hessian, group_size=32, act_order=act_order)
    clip = search_clip(weight, hessian, group_size=32)
    assert torch.equal(gptq.codes, quantize_clipped(weight, clip, group_size=32).codes)


def test_a_short_last_group_and_dead_inputs_are_handled():
    x = correlated_inputs(1024, 96)
    x[:, 5] = 0.0  # an input that never fires
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(3))
    result = gptq_quantize(weight, hessian_of(x), group_size=64, act_order=True)
    assert result.scales.shape == result.mins.shape == (16, 2)
    assert int(result.codes.max()) <= 15
    assert torch.isfinite(result.dequantize()).all()


def test_the_hessian_is_twice_the_mean_outer_product():
    x = torch.randn(300, 8, dtype=torch.float64)
    torch.testing.assert_close(hessian_of(x.float()), 2 * x.T @ x / 300, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_clear_errors():
    weight = torch.randn(8, 64)
    with pytest.raises(ValueError, match="hessian shape"):
        gptq_quantize(weight, torch.eye(32), group_size=32)
    with pytest.raises(ValueError, match="damp_percent"):
        gptq_quantize(weight, torch.eye(64), group_size=32, damp_percent=0.0)
    with pytest.raises(ValueError, match="no calibration rows"):
        HessianAccumulator(4).hessian()
