"""Group-wise int4: packing, round-to-nearest error, and the layer against its reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.quant.int4 import Int4Linear, Int4Method, int4_row_bytes, pack_int4, quantize_int4
from tokenmill.quant.int8 import Int8Linear

# fp16 rounding of the stored min can push a value up to this fraction of |min| past the grid.
FP16_RELATIVE = 2**-11


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5), k=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_unpack_inverts_pack(rows: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, k), dtype=torch.uint8, generator=gen)
    packed = pack_int4(codes)
    assert packed.shape == (rows, int4_row_bytes(k))
    assert torch.equal(ops.unpack_int4(packed, k), codes)


def test_byte_i_holds_inputs_i_and_i_plus_32() -> None:
    codes = torch.zeros(1, 64, dtype=torch.uint8)
    codes[0, 5], codes[0, 37] = 3, 12
    packed = pack_int4(codes)
    assert packed[0, 5].item() == 3 | 12 << 4
    assert packed.count_nonzero().item() == 1


@pytest.mark.parametrize(("k", "group_size"), [(64, 32), (576, 128), (80, 64), (1, 32)])
def test_round_to_nearest_moves_each_weight_at_most_half_a_step(k: int, group_size: int) -> None:
    weight = torch.randn(48, k, generator=torch.Generator().manual_seed(k))
    codes, scales, mins = quantize_int4(weight, group_size)
    dequantized = ops.dequantize_int4_reference(pack_int4(codes), scales, mins, group_size, k)
    step = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    offset = mins.float().abs().repeat_interleave(group_size, dim=1)[:, :k]
    assert ((weight - dequantized).abs() <= step / 2 + offset * FP16_RELATIVE + 1e-6).all()


def test_short_last_group_spans_only_its_own_inputs() -> None:
    weight = torch.randn(4, 80)
    weight[:, 64:] = torch.linspace(1.0, 2.0, 16)  # the last group (16 inputs) lies in [1, 2]
    _, scales, mins = quantize_int4(weight, 64)
    torch.testing.assert_close(mins[:, 1].float(), torch.ones(4), atol=1e-3, rtol=0)
    torch.testing.assert_close(scales[:, 1].float(), torch.full((4,), 1 / 15), atol=1e-3, rtol=0)


def test_constant_groups_round_trip_exactly() -> None:
    weight = torch.full((2, 64), 0.25)
    layer = Int4Linear.from_float(weight, group_size=32)
    assert torch.equal(layer.dequantize(), weight)


def test_layer_output_is_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(70, 200, generator=gen), torch.randn(70, generator=gen)
    layer = Int4Linear.from_float(weight, bias, group_size=64)
    x = torch.randn(3, 200, generator=gen)
    expected = F.linear(
        ops.kernel_activations(x, ops.INT4_WEIGHT_ACTIVATION_BITS), layer.dequantize(), bias
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_from_codes_rebuilds_the_same_layer() -> None:
    weight = torch.randn(8, 96)
    codes, scales, mins = quantize_int4(weight, 32)
    layer = Int4Linear.from_codes(codes, scales, mins, 32)
    rounded = Int4Linear.from_float(weight, group_size=32)
    assert torch.equal(layer.dequantize(), rounded.dequantize())
    with pytest.raises(ValueError, match="scales and mins must be"):
        Int4Linear.from_codes(codes, scales[:, :2], mins, 32)


def test_int4_method_keeps_the_head_in_int8() -> None:
    method = Int4Method(group_size=64)
    head = torch.nn.Linear(16, 8, bias=False)
    assert isinstance(method.quantize_linear("lm_head", head), Int8Linear)
    body = method.quantize_linear("layers.0.mlp.down_proj", head)
    assert isinstance(body, Int4Linear) and body.group_size == 64


@pytest.mark.parametrize("group_size", [0, 48, 100, "32", True])
def test_bad_group_sizes_are_refused(group_size: object) -> None:
    with pytest.raises(ValueError, match="group_size"):
        Int4Linear(64, 8, bias=False, group_size=group_size)  # type: ignore[arg-type]
