"""The quantized paged KV cache (`kv_cache_dtype="int8"` or `"fp8"`): one layer's K and V as 8-bit
codes with an fp32 scale per token and KV head, about a quarter of fp32's bytes.

A layer's cache is either a plain tensor `[2, num_blocks, block_size, kv_heads, d]` in the model
dtype (`"auto"`) or a `QuantizedKVCache`. The model code passes either to `attention()` without
looking inside; attention, the runner's block copies and the engine's sizing ask this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import ops

KV_STORAGE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_BYTES = 4  # one fp32 scale per token, KV head and K/V half


@dataclass(frozen=True)
class QuantizedKVCache:
    """values: int8 or float8_e4m3fn `[2, num_blocks, block_size, kv_heads, d]` (K then V);
    scales: fp32 `[2, num_blocks, block_size, kv_heads]`; x ~= values * scale, the scale being
    max|x| / 127 (int8) or / 448 (fp8) over the token's head."""

    values: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def zeros(
        cls, kv_cache_dtype: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
    ) -> QuantizedKVCache:
        shape = (2, num_blocks, block_size, kv_heads)
        values = torch.zeros(*shape, head_dim, dtype=KV_STORAGE_DTYPES[kv_cache_dtype])
        return cls(values, torch.zeros(shape, dtype=torch.float32))

    def store(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ops.store_kv_quantized(self.values, self.scales, slot_mapping, k, v)

    def decode_attention(
        self,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return ops.paged_decode_attention_quantized(
            q, self.values, self.scales, block_tables, seq_lens, scale, window, key_mask
        )

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 keys and values `[len(block_ids) * block_size, kv_heads, d]` of these blocks."""
        keys, values = (
            ops.gather_blocks_dequantized(self.values[i], self.scales[i], block_ids) for i in (0, 1)
        )
        return keys, values

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: blocks `src` onto `dst` (int64 [n]), codes and scales alike.
        index_copy_ has no fp8 kernel, so the codes move as bytes."""
        for tensor in (self.values.view(torch.uint8), self.scales):
            tensor.index_copy_(1, dst, tensor.index_select(1, src))


KVCache = torch.Tensor | QuantizedKVCache


def slot_views(cache: KVCache) -> list[torch.Tensor]:
    """One layer's cache as `[2, num_blocks * block_size, ...]` views, a token slot per row
    (codes as bytes: index_copy_ has no fp8 kernel), for `copy_slots`. Made once per cache."""
    if isinstance(cache, QuantizedKVCache):
        tensors = [cache.values.view(torch.uint8), cache.scales]
    else:
        tensors = [cache]
    return [tensor.view(2, -1, *tensor.shape[3:]) for tensor in tensors]


def copy_slots(views: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy single token slots `src` onto `dst` (flat slot ids, int64 [n]) in one layer's cache,
    given as its `slot_views`; the sources are read before any destination is written."""
    for flat in views:
        flat.index_copy_(1, dst, flat.index_select(1, src))


def allocate_kv_cache(
    kv_cache_dtype: str,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> KVCache:
    """One layer's cache: a plain tensor in the model `dtype` for "auto", else quantized."""
    if kv_cache_dtype == "auto":
        return torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    return QuantizedKVCache.zeros(kv_cache_dtype, num_blocks, block_size, kv_heads, head_dim)


def kv_head_bytes(kv_cache_dtype: str, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) takes in one KV head: d elements, plus its scale when
    quantized (head_dim 64: 256 bytes in fp32, 64 + 4 in int8 or fp8)."""
    if kv_cache_dtype == "auto":
        return head_dim * torch.empty((), dtype=dtype).element_size()
    return head_dim * KV_STORAGE_DTYPES[kv_cache_dtype].itemsize + SCALE_BYTES


def cache_bytes(cache: KVCache) -> int:
    """Memory one layer's cache holds, counted from its tensors (scales included)."""
    tensors = (cache.values, cache.scales) if isinstance(cache, QuantizedKVCache) else (cache,)
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_cache_blocks(cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy blocks `src` onto `dst` in one layer's cache of either kind; the sources are read
    before any destination is written."""
    if isinstance(cache, QuantizedKVCache):
        cache.copy_blocks(src, dst)
    else:
        cache.index_copy_(1, dst, cache.index_select(1, src))
