"""W8A8 products: native per-token quantization and rescale give the torch reference's bits, on
AVX2 (oneDNN's AVX2 GEMM included) and AVX-512 alike; the product is exact integer arithmetic up
to fp32 rounding; decode rows hand the loop int8's panel kernel under the w8a8 name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import ops
from tokenmill.kernels.w8a8_linear import int8_gemm_reference

from .cases import needs_native

needs_onednn = pytest.mark.skipif(not ops.ONEDNN_AVAILABLE, reason="needs torch's oneDNN")


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows with an outlier channel, one all positive, one all negative and one all zero."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[:, 0] += 40
    if rows >= 4:
        x[1], x[2], x[3] = x[1].abs(), -x[2].abs(), 0.0
    return x


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """SmoothQuant's weight tensors: codes -63..63, row scales, scaled row sums, a bias."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-63, 64, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-4
    row_sums = qweight.sum(dim=1, dtype=torch.int32).float() * scales
    return qweight, scales, row_sums, torch.randn(n, generator=gen)


@needs_native
@pytest.mark.parametrize(
    ("rows", "k"), [(1, 576), (4, 1536), (64, 200), (300, 37), (3, 1), (256, 576)]
)
def test_native_token_quantization_is_the_reference_bit_for_bit(rows, k):
    x = _activations(rows, k, rows + k)
    for native, reference in zip(
        ops.quantize_tokens(x), ops.quantize_tokens_reference(x), strict=True
    ):
        assert native.dtype == reference.dtype and torch.equal(native, reference)


@needs_native
@needs_onednn
@pytest.mark.parametrize(("shape", "with_bias"), [((9, 96), True), ((3, 70, 96), False)])
def test_native_product_is_the_reference_bit_for_bit(shape, with_bias):
    qweight, scales, row_sums, bias = _weight(130, 96, 1)
    onednn = ops.OneDNNWeight(qweight)
    x = _activations(shape[0] * (shape[1] if len(shape) == 3 else 1), 96, 2).view(shape)
    bias = bias if with_bias else None
    native = ops.w8a8_linear(x, qweight, scales, row_sums, onednn, bias)
    reference = ops.w8a8_linear_reference(x, qweight, scales, row_sums, onednn, bias)
    assert native.shape == (*shape[:-1], 130) and torch.equal(native, reference)


@pytest.mark.parametrize("with_onednn", [True, False])
def test_product_is_integer_arithmetic_rescaled(with_onednn):
    if with_onednn and not ops.ONEDNN_AVAILABLE:
        pytest.skip("needs torch's oneDNN")
    qweight, scales, row_sums, bias = _weight(70, 200, 3)
    x = _activations(40, 200, 4)
    onednn = ops.OneDNNWeight(qweight) if with_onednn else None
    out = ops.w8a8_linear(x, qweight, scales, row_sums, onednn, bias)
    codes, token_scales, zeros = ops.quantize_tokens_reference(x)
    exact = (codes.int() - zeros[:, None].int()) @ qweight.int().T
    expected = exact.double() * token_scales[:, None].double() * scales.double() + bias.double()
    # A few fp32 roundings, each within 2^-24 of the largest term it handles: the codes' sums
    # reach 255 * sum|q| * scale per row.
    largest = token_scales[:, None] * 255 * (qweight.abs().sum(dim=1) * scales)
    bound = 8 * 2.0**-24 * (expected.abs() + largest.double())
    assert ((out.double() - expected).abs() <= bound).all()


def test_integer_reference_gemm_is_exact():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (7, 300), generator=gen, dtype=torch.uint8)
    weight = torch.randint(-63, 64, (20, 300), generator=gen, dtype=torch.int8)
    exact = (codes.int() @ weight.int().T).float()
    assert torch.equal(int8_gemm_reference(codes, weight), exact)


@pytest.mark.parametrize("product", [ops.w8a8_linear, ops.w8a8_linear_reference])
def test_wrong_input_width_raises_value_error(product):
    qweight, scales, row_sums, _ = _weight(16, 64, 6)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        product(torch.randn(5, 63), qweight, scales, row_sums, None, None)


@needs_native
def test_decode_rows_kernel_is_int8s_under_its_own_name():
    qweight, scales, _, bias = _weight(20, 64, 7)
    panels = ops.pack_int8_panels(qweight, scales[:, None].contiguous())
    kernel = ops.w8a8_linear_kernel(panels, 64, bias)
    assert kernel.kind == "w8a8"
    assert ops.linear_kernel_max_rows(kernel) == ops.W8A8_PANEL_MAX_ROWS
    x = torch.randn(ops.W8A8_PANEL_MAX_ROWS, 64)
    expected = ops.int8_linear(x, qweight, scales[:, None], 64, bias, panels)
    assert torch.equal(
        ops.w8a8_panel_linear(x, qweight, scales[:, None], 64, bias, panels), expected
    )


# Both routes of a layer at every row count around the cut, saved to argv[1].
ROUTES = """
import sys, torch
from tokenmill.quant.smoothquant import SmoothQuantLinear
gen = torch.Generator().manual_seed(0)
layer = SmoothQuantLinear.from_smoothed(torch.randn(100, 200, generator=gen),
                                         torch.randn(100, generator=gen))
torch.save([layer(torch.randn(rows, 200, generator=gen)) for rows in (1, 3, 4, 5, 13, 70)],
           sys.argv[1])
"""


@needs_native
def test_avx2_and_avx512_give_the_same_bits(tmp_path: Path):
    outputs = []
    for avx512 in ("0", "1"):
        path = tmp_path / f"avx512-{avx512}.pt"
        env = {**os.environ, "TOKENMILL_AVX512": avx512}
        if avx512 == "0":  # oneDNN's AVX2 int8 GEMM too: u8 x s8 pairs summed in int16
            env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
        subprocess.run([sys.executable, "-c", ROUTES, str(path)], env=env, check=True)
        outputs.append(torch.load(path))
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))
