"""Unpacked group-wise int4 and the range search GPTQ and AWQ share."""

from __future__ import annotations

import torch

from tokenmill.quant.gptq import HessianAccumulator
from tokenmill.quant.groupwise import Int4Codes, output_error, search_clip


def gram_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    return (acc.hessian() / 2).float()


def test_codes_dequantize_like_the_packed_layer():
    weight = torch.randn(30, 200, generator=torch.Generator().manual_seed(0))
    codes = Int4Codes.round_to_nearest(weight, group_size=64)
    assert codes.scales.shape == (30, 4)  # 200 inputs: three groups of 64 and one of 8
    assert torch.equal(codes.dequantize(), codes.to_linear(None).dequantize())


def test_the_gram_error_is_the_mean_squared_output_change():
    x = torch.randn(900, 64, generator=torch.Generator().manual_seed(1))
    x[:, :6] *= 20
    delta = 0.01 * torch.randn(24, 64)
    expected = (x @ delta.T).pow(2).sum(dim=1).mean().item()
    assert abs(output_error(delta, gram_of(x)).item() - expected) < 1e-3 * expected


def test_clip_search_keeps_full_ranges_it_cannot_improve_and_handles_a_short_group():
    x = torch.randn(500, 80)
    weight = torch.randn(8, 80)
    clip = search_clip(weight, gram_of(x), group_size=32)
    assert clip.shape == (8, 3)
    full = torch.stack([g.abs().amax(dim=1) for g in weight.split(32, dim=1)], dim=1)
    assert (clip <= full + 1e-6).all() and (clip >= 0.5 * full - 1e-6).all()
