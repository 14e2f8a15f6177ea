"""`kv_cache="none"`, the baseline every cache is measured against: nothing is kept between
steps, so each step recomputes every running sequence from its first token."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.kv.block_pool import KVBlock
from tokenmill.kv.kv_manager import KVCacheManager
from tokenmill.request import Request


class NoKVCache(KVCacheManager):
    holds_kv = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return 0

    @property
    def num_free_blocks(self) -> int:
        return 0

    @property
    def max_tokens_per_request(self) -> int | None:
        return None

    def block_ids(self, request_id: str) -> list[int]:
        return []

    def num_blocks_held(self, request_id: str) -> int:
        return 0

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        return []

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> bool:
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        return []

    def trim(self, request: Request, num_tokens: int) -> None:
        pass

    def free(self, request: Request) -> None:
        pass
