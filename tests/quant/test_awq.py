"""AWQ's searches on synthetic layers: lower output error than round-to-nearest."""

from __future__ import annotations

import torch

from tokenmill.quant.awq import ActivationStats, relative_weight_magnitude, search_scales
from tokenmill.quant.groupwise import Int4Codes, output_error, quantize_clipped, search_clip


def outlier_inputs(rows: int, features: int, seed: int = 0) -> torch.Tensor:
    """Activations whose first few channels run 20x larger, as transformer activations do."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen)
    x[:, :6] *= 20
    return x


def stats_of(x: torch.Tensor) -> ActivationStats:
    stats = ActivationStats(x.shape[1])
    for part in x.split(300):
        stats.add(part)
    return stats


def measured_error(x: torch.Tensor, weight: torch.Tensor, quantized: torch.Tensor) -> float:
    return (x @ quantized.T - x @ weight.T).pow(2).sum(dim=1).mean().item()


def test_scaled_and_clipped_rounding_beats_round_to_nearest():
    x = outlier_inputs(2000, 128)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    stats = stats_of(x)
    gram = stats.gram()
    scales = search_scales(
        weight, gram, stats.mean_abs(), relative_weight_magnitude(weight, 32), group_size=32
    )
    scaled_gram = gram / (scales[:, None] * scales[None, :])
    clip = search_clip(weight * scales, scaled_gram, group_size=32)
    awq = quantize_clipped(weight * scales, clip, group_size=32).dequantize() / scales
    rtn = Int4Codes.round_to_nearest(weight, group_size=32).dequantize()
    assert measured_error(x, weight, awq) < 0.7 * measured_error(x, weight, rtn)


def test_scale_search_falls_back_to_plain_rounding_when_nothing_helps():
    """s = 1 is a candidate, so the search never does worse than RTN on its data."""
    x = outlier_inputs(600, 64)
    weight = torch.randn(16, 64)
    stats = stats_of(x)
    scales = search_scales(
        weight, stats.gram(), stats.mean_abs(), relative_weight_magnitude(weight, 32), 32
    )
    chosen = Int4Codes.round_to_nearest(weight * scales, 32).dequantize() / scales
    plain = Int4Codes.round_to_nearest(weight, 32).dequantize()
    gram = stats.gram()
    assert output_error(chosen - weight, gram) <= output_error(plain - weight, gram)


def test_relative_weight_magnitude_is_against_each_groups_largest():
    weight = torch.tensor([[1.0, -2.0, 4.0, -4.0, 0.5], [2.0, 2.0, -1.0, 1.0, 1.0]])
    # Groups of 2: [1, 2], [4, 4], [0.5] in row 0; [2, 2], [1, 1], [1] in row 1.
    expected = torch.tensor([(0.5 + 1.0) / 2, 1.0, 1.0, 1.0, 1.0])
    torch.testing.assert_close(relative_weight_magnitude(weight, 2), expected)
