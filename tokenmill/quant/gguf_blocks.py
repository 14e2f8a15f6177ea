"""Float weights rounded into GGUF blocks: the Q4_K, Q5_K and Q6_K encoders the `gguf` package
lacks (it only decodes them), and the per-tensor types of llama.cpp's Q4_K_M, Q5_K_M and Q6_K
files.

The encoders round to nearest with one pass of scale choices (llama.cpp searches several scales
per sub-block; its files decode the same way, only its rounding errs less). Block layouts are
those `tokenmill.quant.gguf` reads and `gguf.quants` dequantizes.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

Q = GGMLQuantizationType
SUPER_BLOCK = 256
# The file types llama.cpp records in general.file_type (its LLAMA_FTYPE_MOSTLY_*).
FILE_TYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
# Each mix's type for most matrices; Q6_K for the output and, in the _M mixes, for some layers.
_MAIN_TYPE = {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K}
# A k-quant needs rows of whole super-blocks; llama.cpp falls back to these otherwise.
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp32 [..., ] -> their fp16 bytes [..., 2]."""
    return values.half().unsqueeze(-1).view(torch.uint8)


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] floats (K a multiple of 256) -> Q4_K blocks, uint8 [N, K / 256 * 144]. Per 32
    values, a scale and a min (lowest value, at most 0) over codes 0..15; the eight scales and
    mins of a super-block as 6-bit multiples of its fp16 d and dmin."""
    head, q = _scaled_super_blocks(weight, 15)
    return torch.cat((head, _low_nibbles(q)), dim=-1).reshape(weight.shape[0], -1)


def quantize_q5_k(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] floats (K a multiple of 256) -> Q5_K blocks, uint8 [N, K / 256 * 176]: Q4_K's
    scales and mins over codes 0..31, the fifth bits in 32 bytes (bit j of byte l for value
    32 j + l of the super-block) before the low nibbles."""
    head, q = _scaled_super_blocks(weight, 31)
    fifth = (q >> 4).reshape(*q.shape[:2], 8, 32) << torch.arange(8, dtype=torch.uint8)[:, None]
    high_bits = fifth.sum(dim=-2, dtype=torch.uint8)
    blocks = torch.cat((head, high_bits, _low_nibbles(q & 0x0F)), dim=-1)
    return blocks.reshape(weight.shape[0], -1)


def _scaled_super_blocks(weight: torch.Tensor, max_code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's shared part: (d, dmin and the packed 6-bit scales and mins, uint8
    [N, K / 256, 16]; codes 0..max_code, uint8 [N, K / 256, 256])."""
    rows, k = weight.shape
    w = weight.float().reshape(rows, k // SUPER_BLOCK, 8, 32)
    low = w.amin(dim=-1).clamp(max=0.0)
    scale, offset = (w.amax(dim=-1) - low) / max_code, -low
    d = (scale.amax(dim=-1) / 63).half().float()
    dmin = (offset.amax(dim=-1) / 63).half().float()
    s = torch.where(d[..., None] > 0, scale / d[..., None], 0.0).round().clamp(0, 63)
    m = torch.where(dmin[..., None] > 0, offset / dmin[..., None], 0.0).round().clamp(0, 63)
    step, shift = d[..., None] * s, dmin[..., None] * m
    q = torch.where(step[..., None] > 0, (w + shift[..., None]) / step[..., None], 0.0)
    q = q.round().clamp(0, max_code).to(torch.uint8)
    s, m = s.to(torch.uint8), m.to(torch.uint8)
    packed_scales = torch.cat(
        (
            s[..., :4] | ((s[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (s[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ),
        dim=-1,
    )
    head = torch.cat((_f16_bytes(d), _f16_bytes(dmin), packed_scales), dim=-1)
    return head, q.reshape(rows, k // SUPER_BLOCK, SUPER_BLOCK)


def _low_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15, uint8 [N, B, 256] -> [N, B, 128]: each 64 values, the first 32 in the low
    nibbles and the next 32 in the high ones."""
    pairs = q.reshape(*q.shape[:2], 4, 2, 32)
    return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(*q.shape[:2], 128)


def quantize_q6_k(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] floats (K a multiple of 256) -> Q6_K blocks, uint8 [N, K / 256 * 210]. Per 16
    values a scale that maps the one of largest magnitude to code -32; the sixteen scales of a
    super-block as int8 multiples of its fp16 d."""
    rows, k = weight.shape
    w = weight.float().reshape(rows, k // SUPER_BLOCK, 16, 16)
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    scale = extreme / -32
    widest = scale.gather(-1, scale.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    d = (widest / -128).half().float()
    s = torch.where(d[..., None] != 0, scale / d[..., None], 0.0).round().clamp(-128, 127)
    step = d[..., None] * s
    q = torch.where(step[..., None] != 0, w / step[..., None], 0.0).round().clamp(-32, 31)
    q = (q + 32).to(torch.uint8).reshape(rows, -1, 2, 128)  # two halves of 128
    low, high = q & 0x0F, q >> 4
    low_bytes = (low[..., :64] | (low[..., 64:] << 4)).reshape(rows, -1, 128)
    runs = high.reshape(rows, -1, 2, 4, 32)  # run r of 32 takes bits 2r, 2r + 1
    high_bytes = runs[:, :, :, 0] | runs[:, :, :, 1] << 2 | runs[:, :, :, 2] << 4
    high_bytes = (high_bytes | runs[:, :, :, 3] << 6).reshape(rows, -1, 64)
    sub = s.to(torch.int8).view(torch.uint8)
    blocks = torch.cat((low_bytes, high_bytes, sub, _f16_bytes(d)), dim=-1)
    return blocks.reshape(rows, -1)


def quantize_blocks(weight: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """`weight` [N, K] as `qtype` blocks, uint8 [N, bytes per row]."""
    if qtype == Q.Q4_K:
        return quantize_q4_k(weight).numpy()
    if qtype == Q.Q5_K:
        return quantize_q5_k(weight).numpy()
    if qtype == Q.Q6_K:
        return quantize_q6_k(weight).numpy()
    return quants.quantize(weight.float().numpy(), qtype)


def tensor_type(mix: str, gguf_name: str, shape: tuple[int, ...], num_layers: int) -> Q | None:
    """The block type of tensor `gguf_name` in a `mix` ("q4_k_m", "q5_k_m" or "q6_k") file, None
    for one kept as it is (norms, biases: 1-D). The _M mixes follow llama.cpp: Q6_K for the token
    embedding / output and for attn_v and ffn_down in the first and last eighth of the layers and
    every third between, the mix's own type elsewhere; a type that does not fit the rows falls
    back (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0)."""
    if mix not in FILE_TYPES:
        raise ValueError(f"mix must be one of {', '.join(FILE_TYPES)}, got {mix!r}")
    if len(shape) < 2:
        return None
    chosen = _MAIN_TYPE[mix]
    if gguf_name in ("token_embd.weight", "output.weight"):
        chosen = Q.Q6_K
    layer = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$", gguf_name)
    if layer and _more_bits(int(layer.group(1)), num_layers):
        chosen = Q.Q6_K
    block_size, _ = GGML_QUANT_SIZES[chosen]
    return chosen if shape[-1] % block_size == 0 else _FALLBACK[chosen]


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, every third between."""
    return (
        layer < num_layers // 8
        or layer >= 7 * num_layers // 8
        or (layer - num_layers // 8) % 3 == 2
    )
