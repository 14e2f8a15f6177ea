"""The quantized KV cache's kernels (tokenmill/kv/quantized.py): storing keys and values as
8-bit codes with a scale each, reading them back, and decode attention over them.

Codes are int8 or float8_e4m3fn [2, num_blocks, block_size, kv_heads, d] and the fp32 scales
[2, num_blocks, block_size, kv_heads], one per token and KV head: codes = x * (qmax / max|x|),
rounded (int8: to nearest even, fp8: e4m3's own rounding), scale = max|x| / qmax; a head of
zeros gets scale 0 and zero codes.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenmill.kernels.attention import decode_sdpa
from tokenmill.kernels.dispatch import float32_or_bfloat16, native_friendly, native_or
from tokenmill.kernels.kv_store import gather_blocks

KV_CODE_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes [..., d] of `dtype`, fp32 scales [...])."""
    x = x.float()
    max_abs = x.abs().amax(dim=-1)
    # Tensor / tensor, as the native kernel divides: `448.0 / t` would round twice.
    limit = torch.full_like(max_abs, KV_CODE_MAX[dtype])
    inverse = torch.where(max_abs > 0, limit / max_abs, torch.zeros_like(max_abs))
    scaled = (x * inverse[..., None]).clamp(-limit[..., None], limit[..., None])
    codes = torch.round(scaled) if dtype == torch.int8 else scaled
    return codes.to(dtype), max_abs / limit


def dequantize_kv_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 codes * scales[..., None]; codes [..., d], scales [...]."""
    return codes.float() * scales[..., None]


def store_kv_quantized_reference(
    values: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    # As bytes: index_copy_ has no fp8 kernel.
    flat_values = values.view(torch.uint8).view(2, -1, *values.shape[-2:])
    flat_scales = scales.view(2, -1, scales.shape[-1])
    for half, x in enumerate((k, v)):
        codes, x_scales = quantize_kv_reference(x, values.dtype)
        flat_values[half].index_copy_(0, slot_mapping, codes.view(torch.uint8))
        flat_scales[half].index_copy_(0, slot_mapping, x_scales)


def _store_kv_quantized_fits(
    values: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    return (
        slot_mapping.dtype == torch.int64
        and values.is_contiguous()
        and scales.is_contiguous()
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and native_friendly((scales,))
        and float32_or_bfloat16((k, v))
    )


@native_or(store_kv_quantized_reference, _store_kv_quantized_fits)
def store_kv_quantized(
    native: ModuleType,
    values: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`store_kv` into a quantized cache: each token's k and v heads [T, kv_heads, d] (float32,
    or a bfloat16 model's) are quantized on their own and written with their scales at their
    flat slots."""
    native.store_kv_quantized(values, scales, slot_mapping, k, v)


def gather_blocks_dequantized(
    codes: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor
) -> torch.Tensor:
    """`gather_blocks` of one quantized cache half (codes [num_blocks, block_size, kv_heads, d],
    scales [num_blocks, block_size, kv_heads]), as fp32 `[n * block_size, kv_heads, d]`."""
    gathered = gather_blocks(codes.view(torch.uint8), block_ids).view(codes.dtype)
    ids = block_ids.reshape(-1).long()
    row_scales = scales.view(scales.shape[0], -1).index_select(0, ids).view(-1, scales.shape[-1])
    return dequantize_kv_reference(gathered, row_scales)


def paged_decode_attention_quantized_reference(
    q: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    keys, vals = (gather_blocks_dequantized(values[i], scales[i], block_tables) for i in (0, 1))
    return decode_sdpa(q.float(), keys, vals, seq_lens, scale, window, key_mask).to(q.dtype)


def _paged_decode_attention_quantized_fits(
    q: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> bool:
    return (
        values.is_contiguous()
        and scales.is_contiguous()
        and native_friendly((scales,))
        and float32_or_bfloat16((q,))
    )


@native_or(paged_decode_attention_quantized_reference, _paged_decode_attention_quantized_fits)
def paged_decode_attention_quantized(
    native: ModuleType,
    q: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` over a quantized cache. Native reads the 8-bit codes in place
    and dequantizes them inside the online softmax (code * the token's scale), so a decode
    streams a quarter of fp32's KV bytes. A bfloat16 q (a bfloat16 model's) gives the float32
    q's result rounded once, on both paths."""
    return native.paged_decode_attention_quantized(
        q, values, scales, block_tables, seq_lens, scale, window or 0, key_mask
    )
