"""Grammar-constrained decoding's token mask on the logits (csrc/token_bitmask.cpp).

The bitmask is xgrammar's layout, int32 words with bit j of word w set when token 32w + j is
allowed; `apply_token_bitmask` writes -inf over every token of a listed row whose bit is clear.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenmill.kernels.dispatch import float32_or_bfloat16, native_or

_BIT_OF_BYTE = torch.arange(8, dtype=torch.uint8)


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    # A word's bytes in memory order are its tokens in groups of 8, on little-endian machines.
    words = bitmask[rows].contiguous()
    bits = (words.view(torch.uint8).unsqueeze(-1) >> _BIT_OF_BYTE) & 1
    allowed = bits.view(len(rows), -1)[:, : logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _apply_token_bitmask_fits(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> bool:
    return (
        logits.dim() == 2
        and logits.stride(-1) == 1
        and float32_or_bfloat16((logits,))
        and bitmask.dtype == torch.int32
        and bitmask.is_cpu
        and bitmask.dim() == 2
        and bitmask.stride(-1) == 1
        and rows.dtype == torch.int64
        and rows.is_cpu
    )


@native_or(apply_token_bitmask_reference, _apply_token_bitmask_fits)
def apply_token_bitmask(
    native: ModuleType, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """In place: `logits[r, t] = -inf` for each r in `rows` (int64) and each token t whose bit
    is clear in `bitmask[r]`. logits [R, vocab] float32 or bfloat16; bitmask int32 [B, words]
    with at least vocab bits a row. The rows may be any subset, in any order, without repeats."""
    native.apply_token_bitmask(logits, bitmask, rows.contiguous())
