"""The native row argmax against torch.max's indices: the same index in every row, ties, NaNs and
infinities included, for float32 and bfloat16 rows of every length around its vector widths."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import ops

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)
DTYPES = [torch.float32, torch.bfloat16]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(64, 49152), (1, 49152), (3, 1000), (300, 577)])
def test_native_row_argmax_matches_torch_max(dtype: torch.dtype, rows: int, width: int) -> None:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    assert torch.equal(ops._NATIVE.row_argmax(x), ops.row_argmax_reference(x))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 7, 8, 9, 31, 32, 33, 100])
def test_native_row_argmax_takes_the_first_of_ties_and_nans_as_torch_does(
    dtype: torch.dtype, width: int
) -> None:
    """Few distinct values, so most rows tie; some rows hold NaNs (the first one wins), some
    infinities, some are all -inf."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randint(-3, 3, (40, width), generator=gen).to(dtype)
    x[10:20][torch.rand(10, width, generator=gen) < 0.2] = float("nan")
    x[20:30][torch.rand(10, width, generator=gen) < 0.3] = float("inf")
    x[30:35] = float("-inf")
    x[35:40][torch.rand(5, width, generator=gen) < 0.5] = float("-inf")
    assert torch.equal(ops._NATIVE.row_argmax(x), ops.row_argmax_reference(x))


@needs_native
def test_native_row_argmax_reads_a_strided_view() -> None:
    logits = torch.randn(8, 300)
    rows = logits[::2, 50:]
    assert torch.equal(ops.row_argmax(rows), rows.max(dim=-1).indices)


@needs_native
def test_native_row_argmax_rejects_what_it_does_not_cover() -> None:
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16"):
        ops._NATIVE.row_argmax(torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match="must not be empty"):
        ops._NATIVE.row_argmax(torch.empty(2, 0))


def test_row_argmax_falls_back_to_torch_for_other_dtypes() -> None:
    x = torch.randn(4, 33, dtype=torch.float64)
    assert torch.equal(ops.row_argmax(x), x.max(dim=-1).indices)
