"""`kv_cache="contiguous"`, the baseline paged attention is measured against: each request
reserves a whole `max_model_len` span at admission, as a per-request contiguous buffer would,
so the pool holds as many requests as it has spans, whatever their real lengths. Slots are
still addressed through block tables, so the same attention kernels serve both modes; nothing
is shared, and there is no prefix caching."""

from __future__ import annotations

from tokenmill.kv.paged import PagedKVManager


class ContiguousKVManager(PagedKVManager):
    shares_blocks = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        if max_model_len > num_blocks * block_size:
            raise ValueError(
                f"kv_cache='contiguous' reserves max_model_len={max_model_len} slots per "
                f"request but kv_cache_memory holds {num_blocks * block_size}; raise "
                "kv_cache_memory or lower max_model_len"
            )
        self.reserved_tokens = max_model_len

    def _reserved_tokens(self) -> int:
        return self.reserved_tokens
