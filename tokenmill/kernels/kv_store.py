"""Writing keys and values into a paged KV cache, and reading blocks of it back.

The cache is [2, num_blocks, block_size, kv_heads, d] (K then V), float32 or (a bfloat16
model's) bfloat16; a token's slot is `block * block_size + offset`. The quantized cache's
counterparts are in `quantized_kv`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenmill.kernels.dispatch import float32_or_bfloat16, native_or


def store_kv_reference(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _store_kv_fits(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    return (
        slot_mapping.dtype == torch.int64
        and kv_cache.is_contiguous()
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and float32_or_bfloat16((kv_cache, k, v))
    )


@native_or(store_kv_reference, _store_kv_fits)
def store_kv(
    native: ModuleType,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Writes k and v [T, kv_heads, d] into the cache [2, num_blocks, block_size, kv_heads, d]
    at their flat slots (`slot = block * block_size + offset`, int64 [T]). k and v may be
    strided views (column slices of the merged qkv output) whose heads are contiguous. The
    cache, k and v are float32, or (a bfloat16 model's) bfloat16."""
    native.store_kv(kv_cache, slot_mapping, k, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows of one cache half ([num_blocks, block_size, kv_heads, d]) for the given blocks, as
    `[block_ids.numel() * block_size, kv_heads, d]`; index_select on the flattened blocks is
    several times faster than advanced indexing here."""
    flat = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1).long())
    return flat.view(-1, *cache.shape[-2:])
