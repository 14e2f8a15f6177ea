"""Dequantize GGUF block formats with vectorised torch ops, bit-exact with `gguf.quants`.

The `gguf` package's numpy dequantizers dominate model load time. These do the same float32
arithmetic in the same order (f16 scales widened to f32 first, `d * q + m` as two roundings,
never fused), so results are identical bit for bit, but over many blocks per torch op.
Each block function unpacks its values as bytes, then widens and scales them in place in the
caller's output slice: fresh float temporaries would cost more in page faults than the maths.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

# Output elements per chunk: big enough to amortise per-op overhead and use both threads,
# small enough that a chunk's temporaries stay a few MB however large the tensor.
CHUNK_ELEMENTS = 1 << 20

BlockDequantizer = Callable[[torch.Tensor, torch.Tensor], None]


def dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Return the float32 tensor of `shape` stored as `raw` (the tensor's bytes) in `qtype`."""
    if qtype not in _BLOCK_DEQUANTIZERS and qtype not in _REFERENCE_ONLY:
        raise ValueError(f"dequantize: unsupported GGUF tensor type {qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape, dtype=np.int64))
    if not shape or shape[-1] % block_size or raw.size != numel // block_size * type_size:
        raise ValueError(
            f"dequantize: {raw.size} bytes of {qtype.name} do not hold a tensor of shape {shape}"
        )
    if qtype in _REFERENCE_ONLY:  # rare in files: the `gguf` package's own (slower) decoder
        with np.errstate(invalid="ignore", over="ignore"):  # inf scales decode as gguf's do
            values = quants.dequantize(raw.reshape(numel // shape[-1], -1), qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    blocks = raw.reshape(-1, type_size)
    out = torch.empty(blocks.shape[0], block_size, dtype=torch.float32)
    step = max(1, CHUNK_ELEMENTS // block_size)
    for start in range(0, blocks.shape[0], step):
        # A copy per chunk: the bytes usually come from a read-only memmap, which torch
        # refuses to wrap without a warning, and the copy is small next to the output.
        chunk = torch.from_numpy(np.array(blocks[start : start + step]))
        _BLOCK_DEQUANTIZERS[qtype](chunk, out[start : start + step])
    return out.reshape(shape)


def _f16_as_f32(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 at byte `offset` of each block, widened exactly to f32, shaped (n, 1)."""
    return blocks[:, offset : offset + 2].view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Split (n, groups * k) bytes into (n, groups * 2 * k): per group, low nibbles then high."""
    packed = packed.reshape(packed.shape[0], groups, 1, -1)
    split = torch.empty(packed.shape[0], groups, 2, packed.shape[-1], dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=split[:, :, :1])
    torch.bitwise_right_shift(packed, 4, out=split[:, :, 1:])
    return split.reshape(packed.shape[0], -1)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Block of 32: f16 scale, 32 int8 values."""
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_f16_as_f32(blocks, 0))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Block of 32: f16 scale, 16 bytes of 4-bit values offset by 8 (low nibbles first)."""
    out.copy_(_nibbles(blocks[:, 2:], 1).view(torch.int8).sub_(8))
    out.mul_(_f16_as_f32(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Block of 32: f16 scale and f16 minimum, 16 bytes of unsigned 4-bit values."""
    out.copy_(_nibbles(blocks[:, 4:], 1))
    out.mul_(_f16_as_f32(blocks, 0)).add_(_f16_as_f32(blocks, 2))


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Block of 32: f16 scale, 32 fifth bits (little-endian u32), 16 bytes of low nibbles."""
    high = (blocks[:, 2:6, None] >> torch.arange(8, dtype=torch.uint8)).bitwise_and_(1)
    q = _nibbles(blocks[:, 6:], 1).bitwise_or_(high.reshape(out.shape).bitwise_left_shift_(4))
    out.copy_(q.view(torch.int8).sub_(16))
    out.mul_(_f16_as_f32(blocks, 0))


def _q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack 12 bytes into eight 6-bit scales and eight 6-bit mins, as f32 of shape (n, 8, 1).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    first, second, tail = packed.reshape(-1, 3, 4).unbind(dim=1)
    scales = torch.cat((first & 0x3F, (tail & 0x0F) | ((first >> 2) & 0x30)), dim=1)
    mins = torch.cat((second & 0x3F, (tail >> 4) | ((second >> 2) & 0x30)), dim=1)
    return scales.to(torch.float32)[:, :, None], mins.to(torch.float32)[:, :, None]


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Super-block of 256: f16 d and dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.

    Each 64-value group is 32 bytes: low nibbles are its first 32 values, high nibbles the next.
    """
    scales, mins = _q4_k_scales_mins(blocks[:, 4:16])
    grouped = out.view(-1, 8, 32)
    grouped.copy_(_nibbles(blocks[:, 16:], 4).view(-1, 8, 32))
    grouped.mul_(_f16_as_f32(blocks, 0)[:, :, None] * scales)
    grouped.sub_(_f16_as_f32(blocks, 2)[:, :, None] * mins)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Super-block of 256: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d.

    Each 128-value half takes 64 low-nibble bytes (low then high nibbles) and 32 high-bit bytes
    (bit pairs 0-1, 2-3, 4-5, 6-7 for its four runs of 32); one scale per 16 values.
    """
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts).bitwise_and_(0x03)
    q = _nibbles(blocks[:, :128], 2).bitwise_or_(high.reshape(out.shape).bitwise_left_shift_(4))
    grouped = out.view(-1, 16, 16)
    grouped.copy_(q.view(torch.int8).sub_(32).view(-1, 16, 16))
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    grouped.mul_((_f16_as_f32(blocks, 208) * scales)[:, :, None])


_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, BlockDequantizer] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}

# Types a `tokenmill quantize --method gguf-q5_k_m` file holds (Q5_K, and Q5_1 where rows are not
# whole super-blocks) that have no vectorised decoder here.
_REFERENCE_ONLY = frozenset({GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q5_1})
