"""The KV manager for each `kv_cache` mode, built from the engine's sizing."""

from __future__ import annotations

from tokenmill.kv.contiguous import ContiguousKVManager
from tokenmill.kv.disk_tier import DiskTier
from tokenmill.kv.groups import KVGroups
from tokenmill.kv.hybrid import HybridKVManager
from tokenmill.kv.kv_manager import KVCacheManager
from tokenmill.kv.no_cache import NoKVCache
from tokenmill.kv.paged import PagedKVManager


def make_kv_manager(
    mode: str,
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    max_model_len: int,
    groups: KVGroups | None = None,
    max_chunk_tokens: int | None = None,
    cache_ttl_s: float | None = None,
    max_retained_fraction: float = 0.5,
    disk_tier: DiskTier | None = None,
) -> KVCacheManager:
    """`groups` that trim a window only for "paged"; `max_chunk_tokens` (the most tokens a
    request computes in one step, None: a whole prompt) bounds what their windows hold. TTL,
    retention and the disk tier are the paged cache's (EngineArgs checks the mode)."""
    if groups is not None and groups.trims:
        if mode != "paged":
            raise ValueError(f"KV window trimming needs kv_cache='paged', got {mode!r}")
        return HybridKVManager(
            groups,
            num_blocks,
            block_size,
            enable_prefix_caching,
            max_chunk_tokens,
            cache_ttl_s=cache_ttl_s,
            max_retained_fraction=max_retained_fraction,
            disk_tier=disk_tier,
        )
    if mode == "paged":
        return PagedKVManager(
            num_blocks,
            block_size,
            enable_prefix_caching,
            cache_ttl_s=cache_ttl_s,
            max_retained_fraction=max_retained_fraction,
            disk_tier=disk_tier,
        )
    if mode == "contiguous":
        return ContiguousKVManager(num_blocks, block_size, max_model_len)
    if mode == "none":
        return NoKVCache(block_size)
    raise ValueError(f"kv_cache must be one of paged, contiguous, none, got {mode!r}")
