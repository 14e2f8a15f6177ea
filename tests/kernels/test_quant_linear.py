"""The int8/int4 weight kernels against their torch references, and the references' own error.

Bounds (max |a - b| / max |b| over each output):
- native vs reference, both rounding x to int8 blocks the same way: 1e-5. Only the fp32
  summation order differs (integer block sums are exact), ~1e-7 at these sizes.
- dequantization, native vs reference: 1e-6 (one fused multiply-add against two roundings).
- the activation rounding itself, reference vs the exact fp32-activation product, Gaussian x:
  2% for int4 weights' int8 activations (measured ~0.6%: an input moves by at most half a step,
  max|block| / 254), 1e-4 for int8 weights' int16 activations (steps 258x finer).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import ops, quant_linear
from tokenmill.quant.int4 import pack_int4

KERNEL_MAX_RELATIVE_ERROR = 1e-5
DEQUANTIZE_MAX_RELATIVE_ERROR = 1e-6
INT8_ACTIVATIONS_MAX_RELATIVE_ERROR = 2e-2
INT16_ACTIVATIONS_MAX_RELATIVE_ERROR = 1e-4
INPUT_SIZES = [1, 31, 32, 33, 64, 100, 577, 1536]
GROUP_SIZES = [32, 64, 128, None]  # None: one group spanning the row (per-channel)

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def random_int8(
    n: int, k: int, group_size: int | None, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int]:
    row = -(-k // 32) * 32
    group = group_size or row
    qweight = torch.randint(-128, 128, (n, row), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, -(-k // group), generator=gen) * 0.01 + 1e-4).to(dtype)
    return qweight, scales, group


def random_int4(
    n: int, k: int, group_size: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight = torch.randint(0, 256, (n, -(-k // 64) * 32), dtype=torch.uint8, generator=gen)
    groups = -(-k // group_size)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).to(dtype)
    mins = (-torch.rand(n, groups, generator=gen) * 0.15).to(dtype)
    return qweight, scales, mins


@needs_native
@pytest.mark.parametrize("k", INPUT_SIZES)
@pytest.mark.parametrize("bits", [8, 16])
def test_native_activation_rounding_matches_reference_bit_for_bit(k: int, bits: int) -> None:
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 2, 5, 70):
        x = torch.randn(rows, k, generator=gen) * 3
        x[0] = 0.0  # an all-zero row has scale 0 and values 0
        values, scales, sums = ops._NATIVE.quantize_activations(x, bits)
        ref_values, ref_scales, ref_sums = ops.quantize_activations_reference(x, bits)
        assert torch.equal(values, ref_values)
        assert torch.equal(scales, ref_scales)
        assert torch.equal(sums, ref_sums)


@needs_native
@pytest.mark.parametrize("k", INPUT_SIZES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_native_int8_linear_matches_reference(
    k: int, group_size: int | None, scale_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 2, 3, 4, 5, 8, 16, ops.QUANT_KERNEL_MAX_ROWS):
        n = int(torch.randint(1, 70, (1,), generator=gen))
        qweight, scales, group = random_int8(n, k, group_size, scale_dtype, gen)
        x = torch.randn(rows, k, generator=gen)
        bias = torch.randn(n, generator=gen) if rows % 2 else None
        panels = ops.pack_int8_panels(qweight, scales)
        out = ops._NATIVE.int8_linear(x, panels.values, panels.scales, n, group, bias)
        expected = ops.int8_linear_reference(x, qweight, scales, group, bias)
        assert relative_error(out, expected) < KERNEL_MAX_RELATIVE_ERROR, (rows, n)


@needs_native
@pytest.mark.parametrize("k", INPUT_SIZES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_native_int4_linear_matches_reference(
    k: int, group_size: int, scale_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 2, 3, 4, 5, 8, 16, ops.QUANT_KERNEL_MAX_ROWS):
        n = int(torch.randint(1, 70, (1,), generator=gen))
        qweight, scales, mins = random_int4(n, k, group_size, scale_dtype, gen)
        x = torch.randn(rows, k, generator=gen)
        bias = torch.randn(n, generator=gen) if rows % 2 else None
        panels = ops.pack_int4_panels(qweight, scales, mins, k)
        out = ops._NATIVE.int4_linear(
            x, panels.values, panels.scales, panels.mins, n, group_size, bias
        )
        expected = ops.int4_linear_reference(x, qweight, scales, mins, group_size, bias)
        assert relative_error(out, expected) < KERNEL_MAX_RELATIVE_ERROR, (rows, n)


@needs_native
@pytest.mark.parametrize("k", INPUT_SIZES)
@pytest.mark.parametrize("group_size", [32, 128])
def test_native_dequantize_matches_reference(k: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(k)
    qweight, scales, mins = random_int4(37, k, group_size, torch.float16, gen)
    expected = ops.dequantize_int4_reference(qweight, scales, mins, group_size, k)
    out = ops._NATIVE.dequantize_int4(qweight, scales, mins, group_size, k)
    assert relative_error(out, expected) < DEQUANTIZE_MAX_RELATIVE_ERROR
    qweight8, scales8, group = random_int8(37, k, group_size, torch.float32, gen)
    expected = ops.dequantize_int8_reference(qweight8, scales8, group, k)
    out = ops._NATIVE.dequantize_int8(qweight8, scales8, group, k)
    assert relative_error(out, expected) < DEQUANTIZE_MAX_RELATIVE_ERROR


@pytest.mark.parametrize("k", [33, 577])
def test_activation_rounding_stays_within_its_bound(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(4, k, generator=gen)
    qweight, scales, mins = random_int4(64, k, 32, torch.float16, gen)
    rounded = ops.int4_linear_reference(x, qweight, scales, mins, 32)
    exact = F.linear(x, ops.dequantize_int4_reference(qweight, scales, mins, 32, k))
    assert 0 < relative_error(rounded, exact) < INT8_ACTIVATIONS_MAX_RELATIVE_ERROR
    qweight8, scales8, group = random_int8(64, k, None, torch.float32, gen)
    rounded = ops.int8_linear_reference(x, qweight8, scales8, group)
    exact = F.linear(x, ops.dequantize_int8_reference(qweight8, scales8, group, k))
    assert 0 < relative_error(rounded, exact) < INT16_ACTIVATIONS_MAX_RELATIVE_ERROR


@pytest.mark.parametrize("tile_weights", [1 << 21, 700])  # one tile; tiles of 7 rows
def test_wide_inputs_multiply_the_dequantized_weight_in_fp32(
    monkeypatch: pytest.MonkeyPatch, tile_weights: int
) -> None:
    monkeypatch.setattr(quant_linear, "DEQUANTIZE_TILE_WEIGHTS", tile_weights)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, ops.QUANT_KERNEL_MAX_ROWS, 100, generator=gen)
    bias = torch.randn(40, generator=gen)
    qweight, scales, group = random_int8(40, 100, None, torch.float32, gen)
    expected = F.linear(x, ops.dequantize_int8_reference(qweight, scales, group, 100), bias)
    out = ops.int8_linear(x, qweight, scales, group, bias)
    assert relative_error(out, expected) < DEQUANTIZE_MAX_RELATIVE_ERROR
    qweight, scales, mins = random_int4(40, 100, 64, torch.float16, gen)
    expected = F.linear(x, ops.dequantize_int4_reference(qweight, scales, mins, 64, 100), bias)
    out = ops.int4_linear(x, qweight, scales, mins, 64, bias)
    assert relative_error(out, expected) < DEQUANTIZE_MAX_RELATIVE_ERROR


def test_leading_dimensions_are_kept() -> None:
    gen = torch.Generator().manual_seed(1)
    qweight, scales, mins = random_int4(9, 70, 64, torch.float16, gen)
    x = torch.randn(2, 3, 70, generator=gen)
    out = ops.int4_linear(x, qweight, scales, mins, 64)
    assert out.shape == (2, 3, 9)
    flat = ops.int4_linear(x.reshape(6, 70), qweight, scales, mins, 64)
    torch.testing.assert_close(out.reshape(6, 9), flat)


@needs_native
def test_native_kernels_reject_inconsistent_shapes() -> None:
    gen = torch.Generator().manual_seed(2)
    qweight, scales, mins = random_int4(8, 64, 32, torch.float16, gen)
    values, scales, mins, n = ops.pack_int4_panels(qweight, scales, mins, 64)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops._NATIVE.int4_linear(x, values, scales, mins, n, 48, None)
    with pytest.raises(RuntimeError, match="values must be"):
        ops._NATIVE.int4_linear(torch.randn(1, 65), values, scales, mins, n, 32, None)
    with pytest.raises(RuntimeError, match="values must be"):
        ops._NATIVE.int4_linear(x, values, scales, mins, 9, 32, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops._NATIVE.int4_linear(x, values, scales, mins.float(), n, 32, None)


def test_int4_panels_put_each_row_in_its_own_lane() -> None:
    """Input 8v + j of row r sits in byte 4r + j of vector v (low nibble), 8v + 4 + j in its
    high nibble; rows past N are zero."""
    codes = torch.randint(0, 16, (11, 64), dtype=torch.uint8, generator=torch.Generator())
    groups = torch.ones(11, 2, dtype=torch.float16)
    panels = ops.pack_int4_panels(pack_int4(codes), groups, groups, 64)
    qweight = panels.values.view(2, 2, 4, 8, 4)  # [panel, block, vector, row, byte]
    for r, k in ((0, 0), (3, 13), (10, 63), (8, 36)):
        block, v, j, high = k // 32, k % 32 // 8, k % 4, k % 8 >= 4
        byte = int(qweight[r // 8, block, v, r % 8, j])
        assert (byte >> 4 if high else byte & 0x0F) == codes[r, k]
    assert not qweight[1, :, :, 3:].any()


def test_torch_backend_runs_the_references(torch_ops) -> None:
    assert torch_ops.backend() == "torch"
    gen = torch.Generator().manual_seed(3)
    qweight, scales, mins = random_int4(16, 96, 32, torch.float16, gen)
    x = torch.randn(3, 96, generator=gen)
    assert torch.equal(
        torch_ops.int4_linear(x, qweight, scales, mins, 32),
        torch_ops.int4_linear_reference(x, qweight, scales, mins, 32),
    )
    qweight8, scales8, group = random_int8(16, 96, 32, torch.float16, gen)
    assert torch.equal(
        torch_ops.dequantize_int8(qweight8, scales8, group, 96),
        torch_ops.dequantize_int8_reference(qweight8, scales8, group, 96),
    )
