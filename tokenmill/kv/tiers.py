"""The prefix cache's tiers behind one KV pool: the pool's cached blocks, then (optionally) the
disk tier's files, and what moves between the two each step.

One object per pool, shared by every KV-cache group drawing from it (kv/hybrid.py), so a single
path serves one block table and many: a lookup asks the pool, then the disk; a request taking
over a block the disk holds gets a fresh pool block that the runner loads before the step's
forward pass; the cached blocks the pool evicts are saved before their slots are reused. Keys
are whatever the groups cache under (a group's tag follows the chained hash), so one file holds
one group's layers of one block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenmill.kv.block_pool import BlockHash, BlockPool, DiskBlock, EvictedBlock, KVBlock
from tokenmill.kv.disk_tier import DiskTier


class CacheTiers:
    def __init__(self, pool: BlockPool, disk_tier: DiskTier | None = None) -> None:
        """A pool saving to `disk_tier` must record its evictions (`record_evictions`)."""
        if disk_tier is not None and not pool.record_evictions:
            raise ValueError("a pool with a disk tier must record its evictions")
        self.pool = pool
        self.disk_tier = disk_tier
        self._loads: list[tuple[BlockHash, int]] = []  # (hash, block id) to load this step
        self._published_this_step: set[BlockHash] = set()  # their KV is not computed yet

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block with this hash and these token ids: the pool's, else a DiskBlock
        when the disk tier holds it (its payload then staged for loading), else None."""
        block = self.pool.lookup(block_hash, token_ids)
        if block is not None or self.disk_tier is None:
            return block
        token_ids = tuple(token_ids)
        if not self.disk_tier.lookup(block_hash, token_ids):
            return None
        return DiskBlock(block_hash=block_hash, token_ids=token_ids)

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """One more reference on each pool block taken over (DiskBlocks get theirs in
        `load_from_disk`). Done before any allocation of the same step's plan, which could
        otherwise evict a free cached block about to be taken over."""
        self.pool.acquire(block for block in blocks if not isinstance(block, DiskBlock))

    def load_from_disk(self, blocks: Sequence[KVBlock]) -> list[KVBlock]:
        """`blocks` with each DiskBlock replaced by a fresh pool block, cached under its hash at
        once, that the runner loads its KV into before this step's forward pass."""
        if not any(isinstance(block, DiskBlock) for block in blocks):
            return list(blocks)
        taken = []
        for block in blocks:
            if isinstance(block, DiskBlock):
                (target,) = self.pool.allocate(1)
                self._loads.append((block.block_hash, target.block_id))
                self.pool.cache(target, block.block_hash, block.token_ids)
                block = target
            taken.append(block)
        return taken

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Publish a block this step computes: until the step's forward pass its KV is not
        there, so an eviction of it in the same step is not saved."""
        was_cached = block.block_hash is not None
        self.pool.cache(block, block_hash, token_ids)
        if not was_cached and block.block_hash is not None:
            self._published_this_step.add(block.block_hash)

    def take_transfers(self) -> tuple[list[EvictedBlock], list[tuple[BlockHash, int]]]:
        """The cached blocks this step's allocations evicted (to save first: blocks cached in
        this same step have no KV yet and are left out) and the disk blocks to load."""
        saves = [
            block
            for block in self.pool.take_evicted()
            if block.block_hash not in self._published_this_step
        ]
        loads, self._loads = self._loads, []
        self._published_this_step.clear()
        if self.disk_tier is not None:
            self.disk_tier.unstage(keep=[h for h, _ in loads], max_blocks=self.pool.num_blocks)
        return saves, loads

    def blocks_to_persist(self) -> list[EvictedBlock]:
        """Every cached block the disk tier does not hold yet (for a clean shutdown)."""
        if self.disk_tier is None:
            return []
        return [
            EvictedBlock(
                block.block_id,
                block.block_hash,
                block.token_ids,
                block.last_used,
                block.retained_until,
            )
            for block in self.pool.cached_blocks()
            if block.block_hash not in self.disk_tier
        ]

    def expire(self) -> None:
        self.pool.expire()
        if self.disk_tier is not None:
            self.disk_tier.expire()
