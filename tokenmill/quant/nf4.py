"""NF4 weight-only quantization (QLoRA's 4-bit NormalFloat), stored as bitsandbytes stores it.

Each row is cut into groups of `group_size` inputs (64 by default; a row's last group is
zero-padded, so a group never spans two rows) and every weight becomes the nearest of the 16
NF4 values times its group's absmax: codes are bitsandbytes' `quantize_4bit(..., "nf4")` of the
padded weight, bit for bit. The absmax are double-quantized as its `compress_statistics=True`
does: their mean is subtracted, and the rest quantized to 8 bits with the dynamic map per block
of 256, each block's own absmax kept in fp32. About 4.13 bits per weight at group 64.
The tensors' layout is tokenmill/kernels/nf4_linear.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.model.layers import Linear
from tokenmill.quant.int4 import Int4Method, pack_int4
from tokenmill.quant.linear import (
    LM_HEAD,
    QUANTIZE_CHUNK_ROWS,
    QuantLinear,
    frozen,
    num_groups,
    register_quant_linear,
)
from tokenmill.quant.method import QuantMethod, check_bits

NF4_GROUP_SIZE = 64
ABSMAX_BLOCK = 256  # double quantization: absmax per 8-bit block
LUT_BINS = 65536  # bitsandbytes' CPU 8-bit quantizer: steps of [-1, 1] it rounds through
# bitsandbytes clamps an all-zero block's absmax to this before dividing by it.
TINY_ABSMAX = 1e-38


def check_nf4_group_size(group_size: object) -> int:
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or group_size < 1
        or group_size % ops.NF4_UNIT
    ):
        raise ValueError(
            f"group_size must be a positive multiple of 64 for quantization 'nf4' (64, 128, "
            f"256), got {group_size!r}"
        )
    return group_size


@cache
def _nf4_midpoints() -> torch.Tensor:
    return (ops.NF4_VALUES[:-1] + ops.NF4_VALUES[1:]) / 2


def nf4_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [blocks, size] and fp32 absmax [blocks]: each block scaled into [-1, 1] as
    bitsandbytes scales it (times the reciprocal of the clamped absmax, then clamped), each
    value's nearest NF4 value, a tie taking the lower (`bucketize` over the midpoints)."""
    absmax = blocks.abs().amax(dim=-1)
    inverse = 1.0 / absmax.clamp(min=TINY_ABSMAX)
    scaled = torch.clamp(blocks * inverse[:, None], -1, 1)
    codes = torch.bucketize(scaled, _nf4_midpoints(), out_int32=True).to(torch.uint8)
    return codes, absmax


@dataclass(frozen=True)
class Nf4Weight:
    codes: torch.Tensor  # uint8 [N, K'] in 0..15, K' = K padded to whole groups
    qabsmax: torch.Tensor  # uint8 [N, groups]
    absmax2: torch.Tensor  # float32 [ceil(N * groups / 256)]
    offset: torch.Tensor  # float32 [1]


def quantize_nf4(weight: torch.Tensor, group_size: int = NF4_GROUP_SIZE) -> Nf4Weight:
    """The NF4 form of `weight` [N, K]: bitsandbytes' `quantize_4bit(padded, blocksize=
    group_size, quant_type="nf4", compress_statistics=True)` of the zero-padded weight."""
    rows, k = weight.shape
    groups = num_groups(k, group_size)
    codes = torch.empty(rows, groups * group_size, dtype=torch.uint8)
    absmax = torch.empty(rows, groups, dtype=torch.float32)
    for start in range(0, rows, QUANTIZE_CHUNK_ROWS):
        part = slice(start, start + QUANTIZE_CHUNK_ROWS)
        padded = F.pad(weight[part].detach().float(), (0, groups * group_size - k))
        blocks = padded.reshape(-1, group_size)
        block_codes, block_absmax = nf4_codes(blocks)
        codes[part] = block_codes.view(-1, groups * group_size)
        absmax[part] = block_absmax.view(-1, groups)
    qabsmax, absmax2, offset = double_quantize(absmax)
    return Nf4Weight(codes, qabsmax, absmax2, offset)


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 codes of `absmax`'s shape, fp32 block absmax [ceil(n / 256)], fp32 offset [1]):
    bitsandbytes' `quantize_blockwise(absmax - absmax.mean(), blocksize=256)` on the CPU, on the
    absmax in row-major order (a last short block allowed)."""
    flat = absmax.reshape(-1)
    offset = flat.mean()
    centered = flat - offset
    blocks = num_groups(centered.numel(), ABSMAX_BLOCK)
    padded = F.pad(centered, (0, blocks * ABSMAX_BLOCK - centered.numel()))
    block_absmax = padded.view(blocks, ABSMAX_BLOCK).abs().amax(dim=-1)
    inverse = 1.0 / block_absmax.repeat_interleave(ABSMAX_BLOCK)[: centered.numel()]
    codes = _map_codes(torch.clamp(centered * inverse, -1, 1))
    codes[~torch.isfinite(inverse)] = 0  # an all-zero block: bitsandbytes writes code 0
    return codes.view(absmax.shape), block_absmax, offset.reshape(1)


def _map_codes(scaled: torch.Tensor) -> torch.Tensor:
    """The dynamic map's code for each value in [-1, 1] as bitsandbytes' CPU quantizer picks it:
    the value's bin among 65536 even steps of [-1, 1], then that bin's nearest entry. A value
    within half a step of a midpoint may take the farther entry; matching it keeps our codes
    those of bitsandbytes to the bit."""
    bins = ((scaled + 1.0) * 0.5 * (LUT_BINS - 1) + 0.5).to(torch.int64)
    return _bin_codes()[bins]


@cache
def _bin_codes() -> torch.Tensor:
    steps = torch.arange(LUT_BINS, dtype=torch.float32)
    centers = -1.0 + (2.0 * steps) / (LUT_BINS - 1)
    codebook = ops.dynamic_map()
    midpoints = 0.5 * (codebook[:-1] + codebook[1:])
    return torch.searchsorted(midpoints, centers).to(torch.uint8)


@register_quant_linear
class Nf4Linear(QuantLinear):
    kind = "nf4"

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group_size: int = NF4_GROUP_SIZE
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.group_size = check_nf4_group_size(group_size)
        groups = num_groups(in_features, group_size)
        blocks = num_groups(out_features * groups, ABSMAX_BLOCK)
        self.qweight = frozen(
            torch.zeros(out_features, groups * group_size // 2, dtype=torch.uint8)
        )
        self.qabsmax = frozen(torch.zeros(out_features, groups, dtype=torch.uint8))
        self.absmax2 = frozen(torch.zeros(blocks))
        self.offset = frozen(torch.zeros(1))
        self._second: tuple[tuple[int, ...], torch.Tensor] | None = None

    def weight_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qweight, self.qabsmax, self.absmax2, self.offset

    def second_level(self) -> torch.Tensor:
        """`ops.second_level` of this layer, made again only when absmax2 or offset changed."""
        source = tuple(
            v
            for t in (self.absmax2, self.offset)
            for v in (t.data_ptr(), -1 if t.is_inference() else t._version)
        )
        if self._second is None or self._second[0] != source:
            with torch.no_grad():
                self._second = (source, ops.second_level(self.absmax2, self.offset))
        return self._second[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        second = self.second_level() if ops.backend() == "native" else None
        return ops.nf4_linear(x, *self.weight_tensors(), self.group_size, self.bias, second)

    def prepare(self) -> None:
        self.second_level()

    def native_kernel(self) -> object | None:
        return ops.nf4_linear_kernel(
            self.qweight, self.qabsmax, self.second_level(), self.group_size, self.bias
        )

    def dequantize(self) -> torch.Tensor:
        return ops.dequantize_nf4(*self.weight_tensors(), self.group_size, self.in_features)

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind, "group_size": self.group_size}

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group_size: int = NF4_GROUP_SIZE,
    ) -> Nf4Linear:
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, group_size)
        nf4 = quantize_nf4(weight, group_size)
        with torch.no_grad():
            layer.qweight.copy_(pack_int4(nf4.codes))
            layer.qabsmax.copy_(nf4.qabsmax)
            layer.absmax2.copy_(nf4.absmax2)
            layer.offset.copy_(nf4.offset)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer


class Nf4Method(QuantMethod):
    """Every linear rounded to NF4 from its float weight at load time, but the LM head, which
    gets int8 as under the int4 method (so the two differ only in the decoder layers)."""

    name = "nf4"

    def __init__(self, group_size: int = NF4_GROUP_SIZE, bits: int = 4) -> None:
        check_bits(self.name, bits, (4,))
        self.group_size = check_nf4_group_size(group_size)

    def quantize_linear(self, name: str, linear: Linear) -> QuantLinear:
        if name == LM_HEAD:
            return Int4Method().quantize_linear(name, linear)
        return Nf4Linear.from_float(linear.weight, linear.bias, self.group_size)

    def options(self) -> dict[str, Any]:
        return {"bits": 4, "group_size": self.group_size}
