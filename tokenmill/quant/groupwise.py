"""Unpacked group-wise int4: the form GPTQ and AWQ work in before `Int4Linear` packs it.

w ~ code * scale + min, one (scale, min) per output row and group of `group_size` consecutive
inputs (a short last group allowed), scales and mins in fp16 exactly as the kernels store them,
so the values a search settles on are the values the kernel multiplies by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.quant.int4 import Int4Linear, Int4Method, quantize_int4
from tokenmill.quant.linear import LM_HEAD

CLIP_GRID = 20
MAX_CLIP_SHRINK = 0.5
CLIP_ROW_BATCH = 4096  # weight rows per step of the clip search, bounding its memory
# The calibrated methods' default group. The int4 method's 32 reproduces this model's own Q4_1
# blocks exactly, leaving nothing to improve; at 128 (GPTQ's usual) SmolLM2 loses " Paris"
# even with GPTQ, at 64 both methods keep it (docs/quantization.md).
CALIBRATED_GROUP_SIZE = 64


@dataclass(frozen=True)
class Int4Codes:
    codes: torch.Tensor  # uint8 [N, K], each in [0, 15]
    scales: torch.Tensor  # float16 [N, ceil(K / group_size)]
    mins: torch.Tensor  # float16 [N, ceil(K / group_size)]
    group_size: int

    @classmethod
    def round_to_nearest(cls, weight: torch.Tensor, group_size: int) -> Int4Codes:
        """Plain round-to-nearest (the `int4` method): the baseline GPTQ and AWQ must beat."""
        return cls(*quantize_int4(weight, group_size), group_size)

    def dequantize(self) -> torch.Tensor:
        rows, columns = self.codes.shape
        pad = -columns % self.group_size
        codes = F.pad(self.codes, (0, pad)).view(rows, -1, self.group_size).float()
        values = codes * self.scales.float()[..., None] + self.mins.float()[..., None]
        return values.view(rows, -1)[:, :columns]

    def to_linear(self, bias: torch.Tensor | None) -> Int4Linear:
        return Int4Linear.from_codes(self.codes, self.scales, self.mins, self.group_size, bias)


def output_error(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Mean squared output change per calibration row for a weight change `delta` [N, K],
    given the Gram matrix X^T X / rows of the inputs: ||X D^T||^2 = sum_n D_n G D_n^T."""
    return ((delta @ gram) * delta).sum()


def search_clip(weight: torch.Tensor, gram: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per (row, group) largest |w| to keep, `[N, ceil(K / group_size)]`: each group's range
    shrinks where that lowers the group's own share of the output error."""
    blocks = _diagonal_blocks(gram, group_size)
    return torch.cat(
        [_search_clip_rows(part, blocks, group_size) for part in weight.split(CLIP_ROW_BATCH)]
    )


def _search_clip_rows(weight: torch.Tensor, blocks: torch.Tensor, group_size: int) -> torch.Tensor:
    limit = grouped(weight, group_size).abs().amax(dim=-1)
    best_limit = limit.clone()
    best_error = torch.full_like(limit, float("inf"))
    for step in range(int(CLIP_GRID * MAX_CLIP_SHRINK)):
        candidate = limit * (1 - step / CLIP_GRID)
        quantized = quantize_clipped(weight, candidate, group_size).dequantize()
        delta = grouped(quantized - weight, group_size)
        error = torch.einsum("ngk,gkl,ngl->ng", delta, blocks, delta)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_limit = torch.where(better, candidate, best_limit)
    return best_limit


def grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[rows, K]` -> `[rows, groups, group_size]`, a short last group padded with zeros."""
    return F.pad(t, (0, -t.shape[1] % group_size)).view(t.shape[0], -1, group_size)


def _diagonal_blocks(gram: torch.Tensor, group_size: int) -> torch.Tensor:
    """The Gram matrix's `[groups, group_size, group_size]` blocks on the diagonal."""
    pad = -gram.shape[0] % group_size
    padded = F.pad(gram, (0, pad, 0, pad))
    count = padded.shape[0] // group_size
    tiles = padded.view(count, group_size, count, group_size)
    return tiles.diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def quantize_clipped(weight: torch.Tensor, clip: torch.Tensor, group_size: int) -> Int4Codes:
    """Round-to-nearest group-wise codes of `weight` clamped to +-clip per (row, group)."""
    limit = per_column(clip, group_size, weight.shape[1])
    return Int4Codes.round_to_nearest(weight.clamp(-limit, limit), group_size)


def fit_clipped_groups(
    weight: torch.Tensor, gram: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scales and mins `[N, groups]` of each group's clip-searched range."""
    codes = quantize_clipped(weight, search_clip(weight, gram, group_size), group_size)
    return codes.scales, codes.mins


def per_column(group_values: torch.Tensor, group_size: int, columns: int) -> torch.Tensor:
    """`[N, ceil(K / group_size)]` -> `[N, K]` fp32: each group's value over its columns."""
    return group_values.float().repeat_interleave(group_size, dim=1)[:, :columns]


def quantize_lm_head_like_int4(model: nn.Module) -> None:
    """The LM head as the int4 method leaves it (int8, see `Int4Method`), so GPTQ, AWQ and
    round-to-nearest int4 differ only in the decoder layers."""
    model.lm_head = Int4Method().quantize_linear(LM_HEAD, model.lm_head)
