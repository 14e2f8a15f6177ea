"""Where tokens' K and V live: one paged cache tensor per layer (per slot within a KV-cache
group, with window trimming), their bytes per token and per block, and the flat slot each
position of a request writes (`slot = block_id * block_size + offset`)."""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig
from tokenmill.kv.groups import KVGroups, single_group
from tokenmill.kv.quantized import KVCache, allocate_kv_cache, kv_head_bytes


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    groups: KVGroups | None = None,
) -> list[KVCache]:
    """Each layer's cache: `[2, num_blocks, block_size, kv_heads, d]` in `dtype` ("auto"), or
    int8 / fp8 codes with their scales. With KV-cache `groups`, one cache per slot within a
    group, which the layers in that slot of every group share (each at its group's blocks)."""
    groups = groups or single_group(config.num_hidden_layers)
    heads, head_dim = config.num_key_value_heads, config.head_dim
    slots = [
        allocate_kv_cache(kv_cache_dtype, num_blocks, block_size, heads, head_dim, dtype)
        for _ in range(groups.num_slots)
    ]
    return [slots[slot] for slot in groups.slot_of]


def kv_bytes_per_token(
    config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x element size, + a scale when quantized)."""
    per_head = kv_head_bytes(kv_cache_dtype, config.head_dim, dtype)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * per_head


def kv_block_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    kv_cache_dtype: str = "auto",
    groups: KVGroups | None = None,
) -> int:
    """Bytes one pool block holds: a block's tokens in every layer of one group (all layers
    without groups)."""
    num_slots = config.num_hidden_layers if groups is None else groups.num_slots
    per_layer = kv_bytes_per_token(config, dtype, kv_cache_dtype) // config.num_hidden_layers
    return per_layer * num_slots * block_size


def slot_mapping(block_ids: list[int], block_size: int, start: int, stop: int) -> list[int]:
    """The flat cache slots of positions [start, stop) of a sequence with these blocks."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]
