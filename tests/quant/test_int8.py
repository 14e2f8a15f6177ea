"""Symmetric int8, per output channel or per group of inputs."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.quant.int8 import Int8Linear, Int8Method


@pytest.mark.parametrize(("k", "group_size"), [(576, None), (100, None), (576, 32), (80, 64)])
def test_round_to_nearest_moves_each_weight_at_most_half_a_step(
    k: int, group_size: int | None
) -> None:
    weight = torch.randn(40, k, generator=torch.Generator().manual_seed(k))
    layer = Int8Linear.from_float(weight, group_size=group_size)
    group = layer.kernel_group_size
    step = layer.scales.float().repeat_interleave(group, dim=1)[:, :k]
    assert ((weight - layer.dequantize()).abs() <= step / 2 + 1e-7).all()
    assert layer.qweight.abs().max().item() == 127  # each group's largest |w| maps to 127


def test_per_channel_scales_are_fp32_and_group_scales_fp16() -> None:
    weight = torch.randn(6, 70)
    per_channel = Int8Linear.from_float(weight)
    grouped = Int8Linear.from_float(weight, group_size=32)
    assert per_channel.scales.shape == (6, 1) and per_channel.scales.dtype == torch.float32
    assert grouped.scales.shape == (6, 3) and grouped.scales.dtype == torch.float16
    assert per_channel.qweight.shape == grouped.qweight.shape == (6, 96)  # padded to blocks


def test_zero_rows_stay_zero() -> None:
    weight = torch.randn(4, 64)
    weight[2] = 0.0
    layer = Int8Linear.from_float(weight)
    assert layer.dequantize()[2].count_nonzero() == 0


def test_layer_output_is_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(33, 150, generator=gen), torch.randn(33, generator=gen)
    layer = Int8Linear.from_float(weight, bias)
    x = torch.randn(5, 150, generator=gen)
    expected = F.linear(
        ops.kernel_activations(x, ops.INT8_WEIGHT_ACTIVATION_BITS), layer.dequantize(), bias
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_bits_other_than_8_are_refused() -> None:
    with pytest.raises(ValueError, match="bits must be 8"):
        Int8Method(bits=4)
