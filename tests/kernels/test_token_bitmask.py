"""The token-bitmask kernel and its reference: -inf exactly where a listed row's bit is clear,
every other value untouched, for float32 and bfloat16 logits of widths around the 32-token word,
in xgrammar's bitmask layout."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from tokenmill.kernels import ops

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)
DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [49152, 1000, 33, 32, 7]


def random_bitmask(rows: int, width: int, seed: int) -> torch.Tensor:
    """Words of every kind a grammar gives: none allowed, all allowed, and a few bits set."""
    generator = torch.Generator().manual_seed(seed)
    words = (width + 31) // 32
    kind = torch.randint(0, 3, (rows, words), generator=generator)
    sparse = torch.randint(0, 2**31, (rows, words), generator=generator, dtype=torch.int64)
    sparse &= torch.randint(0, 2**31, (rows, words), generator=generator, dtype=torch.int64)
    bitmask = torch.where(kind == 0, 0, torch.where(kind == 1, -1, sparse))
    return bitmask.to(torch.int32)


def masked(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The definition, one bit per token: token t of row r is kept when bit t % 32 of word
    t // 32 is set."""
    tokens = torch.arange(logits.shape[1])
    expected = logits.clone()
    for row in rows:
        kept = (bitmask[row, tokens // 32] >> (tokens % 32)) & 1
        expected[row] = expected[row].masked_fill(kept == 0, float("-inf"))
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_reference_masks_each_clear_bit(dtype: torch.dtype, width: int) -> None:
    logits = torch.randn(6, width).to(dtype)
    bitmask = random_bitmask(6, width, seed=width)
    rows = [4, 0, 3]
    expected = masked(logits, bitmask, rows)
    ops.apply_token_bitmask_reference(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_native_masks_each_clear_bit(dtype: torch.dtype, width: int) -> None:
    logits = torch.randn(64, width).to(dtype)
    bitmask = random_bitmask(64, width, seed=width + 1)
    rows = [*range(1, 64, 2), 0]
    expected = masked(logits, bitmask, rows)
    ops._NATIVE.apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)


@needs_native
def test_native_takes_a_bitmask_wider_than_the_logits() -> None:
    logits = torch.randn(2, 40)
    bitmask = random_bitmask(3, 96, seed=0)
    expected = masked(logits, bitmask, [1])
    ops._NATIVE.apply_token_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.equal(logits, expected)


@needs_native
def test_native_refuses_a_row_outside_the_logits() -> None:
    with pytest.raises(RuntimeError, match="outside"):
        ops._NATIVE.apply_token_bitmask(
            torch.zeros(2, 64), torch.zeros(4, 2, dtype=torch.int32), torch.tensor([2])
        )


@needs_native
def test_native_masks_what_xgrammar_masks_at_a_real_vocabulary_width() -> None:
    logits = torch.randn(8, 49152)
    bitmask = random_bitmask(8, 49152, seed=7)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[2, 5])
    ops._NATIVE.apply_token_bitmask(logits, bitmask, torch.tensor([2, 5]))
    assert torch.equal(logits, expected)
