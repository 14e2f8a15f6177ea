"""The Q5_0 kernel (GGUF's 5-bit blocks at their own 5.5 bits a weight) against its torch
reference, its dequantization against the reference's, and the layout's corner cases.

Bounds (max |a - b| / max |b| over each output), as for the int4 kernel
(tests/kernels/test_quant_linear.py): native vs reference 1e-5 (the integer block sums are exact;
only the fp32 summation order differs); dequantization bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import ops
from tokenmill.quant.int4 import pack_int4

from .cases import needs_native, relative_error

KERNEL_MAX_RELATIVE_ERROR = 1e-5
ROWS = [1, 4, 64, 256]  # the last is past QUANT_KERNEL_MAX_ROWS: the dequantized fp32 product


def q5_0_from_codes(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(qweight, qhigh, scales) of uint8 codes 0..31 [N, K]: the layout GGUF's blocks repack to."""
    n, k = codes.shape
    blocks = -(-k // 32)
    fifth = torch.nn.functional.pad(codes >> 4, (0, blocks * 32 - k)).view(n, blocks, 4, 8)
    qhigh = (fifth << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)
    return pack_int4(codes & 0x0F), qhigh.view(n, -1), scales


def random_q5_0(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, -(-k // 32), generator=gen) * 1e-2 + 1e-4).half()
    return q5_0_from_codes(codes, scales)


def test_codes_unpack_to_what_they_were_packed_from() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 32, (9, 160), dtype=torch.uint8, generator=gen)
    qweight, qhigh, _ = q5_0_from_codes(codes, torch.ones(9, 5).half())
    assert torch.equal(ops.unpack_q5_0(qweight, qhigh, 160), codes)


def test_a_weight_is_its_scale_times_its_code_less_16() -> None:
    codes = torch.arange(32, dtype=torch.uint8)[None]
    weight = q5_0_from_codes(codes, torch.tensor([[0.5]]).half())
    expected = 0.5 * (torch.arange(32, dtype=torch.float32) - 16)
    assert torch.equal(ops.dequantize_q5_0_reference(*weight, 32)[0], expected)


@pytest.mark.parametrize(("n", "k"), [(8, 32), (13, 96), (640, 2048)])
def test_native_dequantization_is_the_references_bit_for_bit(n: int, k: int) -> None:
    weight = random_q5_0(n, k, torch.Generator().manual_seed(n + k))
    assert torch.equal(ops.dequantize_q5_0(*weight, k), ops.dequantize_q5_0_reference(*weight, k))


@needs_native
@pytest.mark.parametrize(("n", "k"), [(8, 32), (13, 96), (21, 200), (640, 2048)])
def test_native_q5_0_linear_matches_reference(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = random_q5_0(n, k, gen)
    bias = torch.randn(n, generator=gen)
    panels = ops.pack_q5_0_panels(*weight, k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        expected = ops.q5_0_linear_reference(x, *weight, bias=bias)
        got = ops.q5_0_linear(x, *weight, bias=bias, panels=panels)
        assert relative_error(got, expected) < KERNEL_MAX_RELATIVE_ERROR
        assert relative_error(ops.q5_0_linear(x, *weight), expected - bias) < (
            KERNEL_MAX_RELATIVE_ERROR
        )


@needs_native
def test_every_fifth_bit_reaches_its_own_input() -> None:
    """A one-hot x reads one weight: every input position, so every bit of the fifth-bit vector."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 32, (16, 64), dtype=torch.uint8, generator=gen)
    weight = q5_0_from_codes(codes, torch.ones(16, 2).half())
    y = ops.q5_0_linear(torch.eye(64), *weight)
    torch.testing.assert_close(y, codes.t().float() - 16, rtol=1e-6, atol=1e-5)


@needs_native
def test_native_kernel_rejects_inconsistent_shapes() -> None:
    weight = random_q5_0(16, 128, torch.Generator().manual_seed(2))
    panels = ops.pack_q5_0_panels(*weight, 128)
    with pytest.raises(RuntimeError, match="values must be contiguous uint8"):
        ops._NATIVE.q5_0_linear(torch.randn(1, 64), *panels.tensors(), 16, 32, None)
    with pytest.raises(RuntimeError, match="groups of 32"):
        ops._NATIVE.q5_0_linear(torch.randn(1, 128), *panels.tensors(), 16, 64, None)


@needs_native
def test_decode_loop_handle_takes_what_the_panel_kernel_takes() -> None:
    weight = random_q5_0(16, 64, torch.Generator().manual_seed(3))
    kernel = ops.q5_0_linear_kernel(ops.pack_q5_0_panels(*weight, 64), None)
    assert kernel.kind == "q5_0"
    assert ops.linear_kernel_max_rows(kernel) == ops.QUANT_KERNEL_MAX_ROWS


def test_torch_backend_runs_the_reference(torch_ops) -> None:
    weight = random_q5_0(8, 64, torch.Generator().manual_seed(4))
    x = torch.randn(2, 64)
    assert torch.equal(torch_ops.q5_0_linear(x, *weight), ops.q5_0_linear_reference(x, *weight))
    assert torch_ops.q5_0_linear_kernel(None, None) is None
