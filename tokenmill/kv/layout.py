"""Where tokens' K and V live: one paged cache tensor per layer, its bytes per token, and the
flat slot each position of a request writes (`slot = block_id * block_size + offset`)."""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig
from tokenmill.kv.quantized import KVCache, allocate_kv_cache, kv_head_bytes


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> list[KVCache]:
    """One cache per layer: `[2, num_blocks, block_size, kv_heads, d]` in `dtype` ("auto"), or
    int8 / fp8 codes with their scales."""
    heads, head_dim = config.num_key_value_heads, config.head_dim
    return [
        allocate_kv_cache(kv_cache_dtype, num_blocks, block_size, heads, head_dim, dtype)
        for _ in range(config.num_hidden_layers)
    ]


def kv_bytes_per_token(
    config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x element size, + a scale when quantized)."""
    per_head = kv_head_bytes(kv_cache_dtype, config.head_dim, dtype)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * per_head


def slot_mapping(block_ids: list[int], block_size: int, start: int, stop: int) -> list[int]:
    """The flat cache slots of positions [start, stop) of a sequence with these blocks."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]
