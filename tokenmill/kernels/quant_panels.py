"""The layouts of int8 and int4 weights (tokenmill/quant builds them): the row-major form that
checkpoints hold, and the panels the native kernels read (csrc/quant_linear.cpp).

Along K a row is cut into blocks of QUANT_BLOCK inputs (zero-padded), and each row has one scale
per group of `group_size` inputs, group_size a multiple of 32 (the last group may be short):
  int8: qweight int8 [N, ceil(K / 32) * 32], w = scale * q; one group per row is per-channel.
  int4: qweight uint8 [N, ceil(K / 64) * 32], w = scale * q + min, q in 0..15; each 64 inputs
        take 32 bytes, input i in the low nibble of byte i, input 32 + i in its high nibble.
scales (and mins) are [N, ceil(K / group_size)], float16 or float32.

GGUF's Q5_0 keeps its 5.5 bits a weight, w = scale * (q - 16) with q in 0..31 and one fp16 scale
per block of 32: qweight holds the low 4 bits as int4 does, qhigh uint8 [N, ceil(K / 32) * 4]
the fifth bits, block b's as GGUF's little-endian 32 bits (bit j: input 32b + j).

The native kernels read a copy regrouped into panels of PANEL_ROWS rows (`pack_int8_panels`,
`pack_int4_panels`, `pack_q5_0_panels`; the quantized layers keep it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

QUANT_BLOCK = 32
PANEL_ROWS = 8


class QuantPanels(NamedTuple):
    """A quantized weight regrouped for the native kernels (csrc/quant_linear.cpp): panels of
    PANEL_ROWS output rows whose codes interleave so that each SIMD lane holds one row."""

    values: torch.Tensor  # uint8 [panels, blocks * bytes per block]
    scales: torch.Tensor  # [panels, groups, PANEL_ROWS]
    mins: torch.Tensor | None  # int4's, like scales
    out_features: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """values, scales and (int4's) mins, in the order the native kernels take them."""
        if self.mins is None:
            return self.values, self.scales
        return self.values, self.scales, self.mins


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 values 0..15 [N, in_features] from the packed int4 layout."""
    units = qweight.view(qweight.shape[0], -1, 1, QUANT_BLOCK)
    nibbles = torch.cat((units & 0x0F, units >> 4), dim=2)  # [N, units, 2, 32]
    return nibbles.view(qweight.shape[0], -1)[:, :in_features]


def _fifth_bits(qhigh: torch.Tensor) -> torch.Tensor:
    """uint8 0 / 1 [N, blocks * 32]: each input's fifth bit from Q5_0's qhigh."""
    bits = (qhigh.view(qhigh.shape[0], -1, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.view(qhigh.shape[0], -1)


def unpack_q5_0(qweight: torch.Tensor, qhigh: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 codes 0..31 [N, in_features] of a Q5_0 weight's (qweight, qhigh)."""
    return unpack_int4(qweight, in_features) | (_fifth_bits(qhigh)[:, :in_features] << 4)


def _panel_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] zero-padded to whole panels, as [panels, PANEL_ROWS, ...]."""
    padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % PANEL_ROWS))
    return padded.view(-1, PANEL_ROWS, *t.shape[1:])


def _panel_groups(per_group: torch.Tensor) -> torch.Tensor:
    """[N, groups] -> [panels, groups, PANEL_ROWS]."""
    return _panel_rows(per_group).transpose(1, 2).contiguous()


def pack_int4_panels(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int
) -> QuantPanels:
    """The int4 weight (qweight, scales, mins) in panels: per panel and block of 32 inputs, four
    32-byte vectors; vector v gives row r the 4 bytes of lane r, byte j holding input 8v + j in
    its low nibble and 8v + 4 + j in its high one."""
    blocks = -(-in_features // QUANT_BLOCK)
    codes = unpack_int4(qweight, qweight.shape[1] * 2)[:, : blocks * QUANT_BLOCK]
    # [panels, row, block, v, half, j] -> [panels, block, v, row, j, half]
    split = _panel_rows(codes).view(-1, PANEL_ROWS, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    values = (split[..., 0] | (split[..., 1] << 4)).contiguous().view(split.shape[0], -1)
    return QuantPanels(values, _panel_groups(scales), _panel_groups(mins), qweight.shape[0])


def pack_q5_0_panels(
    qweight: torch.Tensor, qhigh: torch.Tensor, scales: torch.Tensor, in_features: int
) -> QuantPanels:
    """The Q5_0 weight in panels: per panel and block of 32 inputs, the low 4 bits of the codes
    as `pack_int4_panels` lays them out (128 bytes), then 32 bytes of fifth bits: row r's byte j
    holds in bit v the fifth bit of input 8v + j and in bit 4 + v that of input 8v + 4 + j (the
    inputs whose low bits sit in the low and high nibble of byte j of vector v)."""
    blocks = -(-in_features // QUANT_BLOCK)
    low = pack_int4_panels(qweight, scales, scales, in_features).values
    nibbles = low.view(low.shape[0], blocks, 4 * 32)
    # [panels, row, block, v, half, j] -> [panels, block, row, j, v, half]
    fifth = _panel_rows(_fifth_bits(qhigh)).view(-1, PANEL_ROWS, blocks, 4, 2, 4)
    split = fifth.permute(0, 2, 1, 5, 3, 4)
    weights = (1 << torch.arange(8, dtype=torch.uint8)).view(2, 4).t()  # [v, half]: bit 4h + v
    high = (split * weights).sum(dim=(-2, -1), dtype=torch.uint8).view(-1, blocks, 32)
    values = torch.cat((nibbles, high), dim=-1).view(nibbles.shape[0], -1)
    return QuantPanels(values, _panel_groups(scales), None, qweight.shape[0])


def pack_int8_panels(qweight: torch.Tensor, scales: torch.Tensor) -> QuantPanels:
    """The int8 weight (qweight, scales) in panels: per panel and block of 32 inputs, sixteen
    16-byte units; unit u gives row r bytes 2r and 2r + 1, inputs 2u and 2u + 1."""
    codes = _panel_rows(qweight.view(torch.uint8))
    # [panels, row, block, u, j] -> [panels, block, u, row, j]
    split = codes.view(codes.shape[0], PANEL_ROWS, -1, 16, 2).permute(0, 2, 3, 1, 4)
    values = split.contiguous().view(codes.shape[0], -1)
    return QuantPanels(values, _panel_groups(scales), None, qweight.shape[0])
