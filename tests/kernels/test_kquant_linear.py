"""The Q6_K kernel (with and without the mins of the q5_k layout) against its torch reference,
and the reference's own activation rounding.

Bounds (max |a - b| / max |b| over each output), as for the int8 kernels
(tests/kernels/test_quant_linear.py): native vs reference 1e-5 (integer half-block sums are
exact; only the fp32 summation order differs); the int16 rounding of x itself 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import ops

KERNEL_MAX_RELATIVE_ERROR = 1e-5
INT16_ACTIVATIONS_MAX_RELATIVE_ERROR = 1e-4
ROWS = [1, 4, 64, 256]  # the last is past QUANT_KERNEL_MAX_ROWS: the dequantized fp32 product

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def random_q6_k(
    n: int, k: int, gen: torch.Generator, with_mins: bool = False
) -> tuple[torch.Tensor, ...]:
    """(qweight, sub_scales, super_scales, mins or None); with mins, Q5_K-like codes 0..31."""
    low, high = (0, 32) if with_mins else (-32, 32)
    qweight = torch.randint(low, high, (n, k), dtype=torch.int8, generator=gen)
    sub_scales = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    super_scales = (torch.rand(n, k // 256, generator=gen) * 1e-3 + 1e-5).half()
    mins = -torch.rand(n, k // 32, generator=gen) * 0.1 if with_mins else None
    return qweight, sub_scales, super_scales, mins


@needs_native
@pytest.mark.parametrize(("n", "k"), [(8, 256), (13, 512), (640, 2048)])
@pytest.mark.parametrize("with_mins", [False, True], ids=["q6_k", "q5_k"])
def test_native_q6_k_linear_matches_reference(n: int, k: int, with_mins: bool) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = random_q6_k(n, k, gen, with_mins)
    bias = torch.randn(n, generator=gen)
    panels = ops.pack_q6_k_panels(*weight)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        expected = ops.q6_k_linear_reference(x, *weight, bias=bias)
        assert relative_error(ops.q6_k_linear(x, *weight, bias=bias, panels=panels), expected) < (
            KERNEL_MAX_RELATIVE_ERROR
        )
        assert relative_error(ops.q6_k_linear(x, *weight), expected - bias) < (
            KERNEL_MAX_RELATIVE_ERROR
        )


@pytest.mark.parametrize("with_mins", [False, True], ids=["q6_k", "q5_k"])
def test_activation_rounding_stays_within_its_bound(with_mins: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = random_q6_k(64, 1024, gen, with_mins)
    x = torch.randn(4, 1024, generator=gen)
    exact = F.linear(x, ops.dequantize_q6_k_reference(*weight))
    assert relative_error(ops.q6_k_linear_reference(x, *weight), exact) < (
        INT16_ACTIVATIONS_MAX_RELATIVE_ERROR
    )


def test_each_half_block_has_its_own_scale() -> None:
    """A one-hot input reads one code times d * s of its own 16 inputs."""
    qweight = torch.full((1, 256), 3, dtype=torch.int8)
    sub_scales = torch.arange(1, 17, dtype=torch.int8)[None]
    super_scales = torch.tensor([[0.5]], dtype=torch.float16)
    x = torch.zeros(16, 256)
    x[torch.arange(16), torch.arange(16) * 16] = 1.0
    y = ops.q6_k_linear(x, qweight, sub_scales, super_scales)
    expected = 3 * 0.5 * torch.arange(1, 17, dtype=torch.float32)
    torch.testing.assert_close(y[:, 0], expected, rtol=1e-6, atol=0)


def test_a_min_adds_itself_times_the_sum_of_its_blocks_inputs() -> None:
    qweight = torch.zeros(1, 256, dtype=torch.int8)
    sub_scales = torch.ones(1, 16, dtype=torch.int8)
    super_scales = torch.ones(1, 1, dtype=torch.float16)
    mins = torch.zeros(1, 8)
    mins[0, 3] = -0.25
    x = torch.zeros(1, 256)
    x[0, 96:128] = 2.0  # block 3
    x[0, :32] = 5.0  # block 0, whose min is 0
    y = ops.q6_k_linear(x, qweight, sub_scales, super_scales, mins)
    torch.testing.assert_close(y, torch.tensor([[-0.25 * 64]]), rtol=1e-6, atol=0)


def test_leading_dimensions_are_kept() -> None:
    weight = random_q6_k(16, 256, torch.Generator().manual_seed(1))
    assert ops.q6_k_linear(torch.randn(2, 3, 256), *weight).shape == (2, 3, 16)


@needs_native
def test_native_kernel_rejects_inconsistent_shapes() -> None:
    weight = random_q6_k(16, 512, torch.Generator().manual_seed(2))
    panels = ops.pack_q6_k_panels(*weight)
    with pytest.raises(RuntimeError, match="values must be contiguous uint8"):
        ops._NATIVE.q6_k_linear(torch.randn(1, 256), *panels.tensors(), 16, None)
    with pytest.raises(RuntimeError, match="multiple of 256 inputs"):
        ops._NATIVE.q6_k_linear(torch.randn(1, 320), *panels.tensors(), 16, None)
    values, sub_scales, super_scales, _ = panels.tensors()
    with pytest.raises(RuntimeError, match="mins must be contiguous float32"):
        ops._NATIVE.q6_k_linear(
            torch.randn(1, 512), values, sub_scales, super_scales, torch.zeros(2, 8, 8), 16, None
        )


@needs_native
def test_decode_loop_handle_takes_what_the_panel_kernel_takes() -> None:
    weight = random_q6_k(16, 256, torch.Generator().manual_seed(3))
    kernel = ops.q6_k_linear_kernel(ops.pack_q6_k_panels(*weight), None)
    assert kernel.kind == "q6_k"
    assert ops.linear_kernel_max_rows(kernel) == ops.QUANT_KERNEL_MAX_ROWS


def test_torch_backend_runs_the_reference(torch_ops) -> None:
    weight = random_q6_k(8, 256, torch.Generator().manual_seed(4))
    x = torch.randn(2, 256)
    assert torch.equal(torch_ops.q6_k_linear(x, *weight), ops.q6_k_linear_reference(x, *weight))
    assert torch_ops.q6_k_linear_kernel(torch_ops.pack_q6_k_panels(*weight), None) is None
