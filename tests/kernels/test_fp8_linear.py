"""The fp8 (e4m3) weight kernels against their torch references.

Bounds: decoding is exact (every code's value, scaled by a power of two), so dequantization
matches the reference bit for bit; the product differs from F.linear on the dequantized weight
only in float32 summation order and where the row scale is applied, ~1e-7 relative here.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import ops

KERNEL_MAX_RELATIVE_ERROR = 1e-5

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)


def random_fp8(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3 code (0x7f and 0xff are NaN) and row scales around 1e-3."""
    codes = torch.randint(0, 255, (n, k), dtype=torch.uint8, generator=gen)
    codes[codes == 0x7F] = 0x7E
    scales = torch.rand(n, generator=gen) * 1e-3 + 1e-5
    return codes.view(torch.float8_e4m3fn), scales


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_reference_decodes_every_code_exactly() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    expected = codes.float().view(16, 16)
    finite = ~expected.isnan()
    decoded = ops.dequantize_fp8_reference(codes.view(16, 16), torch.ones(16))
    assert torch.equal(decoded[finite], expected[finite])


@needs_native
@pytest.mark.parametrize("k", [1, 7, 8, 13, 64, 577, 1536])
def test_native_dequantization_is_the_reference_bit_for_bit(k: int) -> None:
    codes, scales = random_fp8(37, k, torch.Generator().manual_seed(k))
    expected = ops.dequantize_fp8_reference(codes, scales)
    assert torch.equal(ops.dequantize_fp8(codes, scales), expected)


@needs_native
@pytest.mark.parametrize("k", [1, 7, 8, 13, 64, 577])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, ops.SKINNY_MAX_ROWS, ops.SKINNY_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_product_matches_the_reference(k: int, rows: int, with_bias: bool) -> None:
    """Odd K (a decoded tail), odd N (a part tile), and x both sides of the skinny limit."""
    gen = torch.Generator().manual_seed(k * 100 + rows)
    codes, scales = random_fp8(11, k, gen)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(11, generator=gen) if with_bias else None
    expected = F.linear(x, ops.dequantize_fp8_reference(codes, scales), bias)
    assert relative_error(ops.fp8_linear(x, codes, scales, bias), expected) < (
        KERNEL_MAX_RELATIVE_ERROR
    )


@needs_native
def test_product_keeps_leading_dims_and_wide_weights_tile() -> None:
    gen = torch.Generator().manual_seed(0)
    codes, scales = random_fp8(ops.DEQUANTIZE_TILE_WEIGHTS // 64 + 5, 64, gen)
    x = torch.randn(2, 40, 64, generator=gen)  # 80 rows: the tiled GEMM path, over two tiles
    expected = F.linear(x, ops.dequantize_fp8_reference(codes, scales))
    out = ops.fp8_linear(x, codes, scales)
    assert out.shape == (2, 40, codes.shape[0])
    assert relative_error(out, expected) < KERNEL_MAX_RELATIVE_ERROR


@needs_native
def test_native_product_rejects_bad_layouts() -> None:
    codes, scales = random_fp8(4, 16, torch.Generator().manual_seed(0))
    x = torch.randn(1, 16)
    with pytest.raises(RuntimeError, match="scales must be a contiguous float32"):
        ops.fp8_linear(x, codes, scales[:3])
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops.fp8_linear(torch.randn(1, 15), codes, scales)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        ops.fp8_linear(x, codes.view(torch.uint8), scales)
