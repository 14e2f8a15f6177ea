"""The pool of fixed-size KV blocks: who holds each block, and which full blocks are cached.

A block with no holders goes to the back of the free queue but keeps its cached contents, so a
later request with the same prefix can take it back; allocation takes from the front, so the
least recently freed cached block is the one evicted.

Two clocks bound how long a cached block lives. `cache_ttl_s`: a free cached block unused for
longer is dropped at the next `expire()`. Retention (`retain`): a request may ask for its
prompt's blocks to be kept until a time; such a free block waits outside the LRU queue and is
taken only when no other free block is left, so it yields to running requests and never causes
a preemption. At most `max_retained_blocks` blocks are retained at once.

With `record_evictions`, every cached block that allocation evicts is listed (`take_evicted`)
so its KV can be saved to a slower tier before its slots are overwritten.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenmill.scheduler_output import EvictedBlock

BlockHash = bytes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set while the block's contents are in the prefix cache
    token_ids: tuple[int, ...] = ()
    last_used: float = 0.0  # clock time its last holder let it go
    retained_until: float | None = None  # a request asked the cache to keep it until then


@dataclass(eq=False)
class DiskBlock(KVBlock):
    """A prefix block the disk tier holds and the pool does not: `block_id` stays -1 until
    `allocate_slots` gives it a pool block to load into."""

    block_id: int = -1


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """A full block's identity: a 128-bit digest chained through its parent's, so equal blocks
    at different prefixes differ. A hit also compares the token ids themselves."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        cache_ttl_s: float | None = None,
        max_retained_blocks: int = 0,
        clock: Callable[[], float] = time.time,
        record_evictions: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.cache_ttl_s = cache_ttl_s
        self.max_retained_blocks = max_retained_blocks
        self.clock = clock
        self.record_evictions = record_evictions
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._free_retained: dict[int, KVBlock] = {}  # free, but kept out of the LRU queue
        self._retained: dict[int, KVBlock] = {}  # every block with a retention, held or free
        self._cached: dict[BlockHash, KVBlock] = {}
        self._evicted: list[EvictedBlock] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached and retained ones included: all can be allocated."""
        return len(self._free) + len(self._free_retained)

    @property
    def num_retained_blocks(self) -> int:
        return len(self._retained)

    def cached_blocks(self) -> list[KVBlock]:
        return list(self._cached.values())

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        block = self._cached.get(block_hash) if self.enable_caching else None
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def allocate(self, count: int) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks with {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            block = self._take_free_block()
            self._evict(block, record=True)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on cached blocks a new request reuses."""
        for block in blocks:
            if block.ref_count == 0 and self._free.pop(block.block_id, None) is None:
                del self._free_retained[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; callers pass a table tail-first, so when memory runs
        short the ends of sequences are evicted before the prefixes other requests share.
        A block with nothing cached goes to the front: reusing it evicts nobody's prefix."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                block.last_used = self.clock()
                if block.retained_until is not None:
                    self._free_retained[block.block_id] = block
                    continue
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Publish a full block's contents; the first block cached under a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def retain(self, blocks: Iterable[KVBlock], until: float) -> None:
        """Keep these cached blocks out of LRU eviction until `until`, while fewer than
        `max_retained_blocks` are retained (the rest stay plain cached blocks)."""
        for block in blocks:
            if block.block_hash is None:
                continue
            if block.retained_until is None:
                if len(self._retained) >= self.max_retained_blocks:
                    continue
                self._retained[block.block_id] = block
                if block.ref_count == 0:
                    del self._free[block.block_id]
                    self._free_retained[block.block_id] = block
            block.retained_until = max(block.retained_until or until, until)

    def expire(self) -> None:
        """End the retentions that ran out (their blocks rejoin the LRU queue as last used
        then), and drop free cached blocks unused for longer than the cache TTL."""
        now = self.clock()
        for block in [b for b in self._retained.values() if b.retained_until <= now]:
            self._end_retention(block)
        if self.cache_ttl_s is None:
            return
        stale = [
            block
            for block in self._free.values()
            if block.block_hash is not None and block.last_used + self.cache_ttl_s <= now
        ]
        for block in stale:
            self._evict(block, record=False)
            self._free.move_to_end(block.block_id, last=False)

    def take_evicted(self) -> list[EvictedBlock]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def _take_free_block(self) -> KVBlock:
        """The LRU queue's front; a retained block (the one whose retention ends first) only
        when the queue is empty."""
        if self._free:
            return self._free.popitem(last=False)[1]
        block = min(self._free_retained.values(), key=lambda b: b.retained_until or 0.0)
        del self._free_retained[block.block_id]
        return block

    def _end_retention(self, block: KVBlock) -> None:
        block.retained_until = None
        del self._retained[block.block_id]
        if self._free_retained.pop(block.block_id, None) is not None:
            self._free[block.block_id] = block

    def _evict(self, block: KVBlock, record: bool) -> None:
        """Forget the block's contents; with `record`, list them for the disk tier first (a
        retention still running goes with them: the tier keeps the block until then)."""
        if block.block_hash is not None:
            if record and self.record_evictions:
                self._evicted.append(
                    EvictedBlock(
                        block.block_id,
                        block.block_hash,
                        block.token_ids,
                        block.last_used,
                        block.retained_until,
                    )
                )
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        if block.retained_until is not None:
            block.retained_until = None
            del self._retained[block.block_id]
