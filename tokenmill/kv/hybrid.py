"""`kv_cache="paged"` for a model with KV-cache groups (tokenmill/kv/groups.py): one block table
per group and request over one shared BlockPool.

A full-attention group's table grows as tokens arrive, like the single table of
`PagedKVManager`; a sliding-window group gives back every block its next query no longer reads,
its entry becoming the null block (block 0, held forever, never written: the attention kernels
never read a position outside the window). Allocation is all-or-nothing across the groups.

A prefix-cache hit of L blocks needs each full group's first L blocks and, of a sliding group,
only the blocks a query starting at L * block_size still reads: the longest L for which every
group has them wins. Each of those blocks may come from the pool or, with a disk tier, from
its file (one per group and block: the group's layers only), through the pool's `CacheTiers`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.kv.block_pool import BlockHash, BlockPool, EvictedBlock, KVBlock
from tokenmill.kv.disk_tier import DiskTier
from tokenmill.kv.groups import KVGroups
from tokenmill.kv.kv_manager import KVCacheManager
from tokenmill.kv.paged import PagedKVManager
from tokenmill.kv.plan import blocks_for_tokens
from tokenmill.kv.tiers import CacheTiers
from tokenmill.request import Request


class GroupedBlocks(list[KVBlock]):
    """Blocks a request takes over (a prefix-cache hit, or a parent's prompt): the first group's
    as the list itself, so its length counts the blocks for the scheduler, and every group's in
    `per_group`."""

    def __init__(self, per_group: Sequence[list[KVBlock]]) -> None:
        super().__init__(per_group[0])
        self.per_group = tuple(per_group)


class HybridKVManager(KVCacheManager):
    shares_blocks = True

    def __init__(
        self,
        groups: KVGroups,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        max_chunk_tokens: int | None = None,
        cache_ttl_s: float | None = None,
        max_retained_fraction: float = 0.5,
        disk_tier: DiskTier | None = None,
    ) -> None:
        """`max_chunk_tokens`: the most tokens a request computes in one step (the token budget
        with chunked prefill, None: a whole prompt at once), which a sliding group must hold
        together with the window before them. `cache_ttl_s`, `max_retained_fraction`: the
        shared pool's TTL and retention (BlockPool); `disk_tier`: where evicted cached blocks
        go, and prefix lookups continue."""
        if num_blocks < 2:
            raise ValueError(f"a KV pool with window trimming needs 2 blocks, got {num_blocks}")
        self.block_size = block_size
        self.kv_groups = groups
        self.max_chunk_tokens = max_chunk_tokens
        self.pool = BlockPool(
            num_blocks,
            enable_caching=enable_prefix_caching,
            cache_ttl_s=cache_ttl_s,
            max_retained_blocks=int(max_retained_fraction * num_blocks),
            record_evictions=disk_tier is not None,
        )
        self.tiers = CacheTiers(self.pool, disk_tier)
        (self.null_block,) = self.pool.allocate(1)
        self.groups = [
            PagedKVManager(
                num_blocks,
                block_size,
                tiers=self.tiers,
                window=group.window,
                null_block=self.null_block,
                hash_tag=bytes([g]),
            )
            for g, group in enumerate(groups.groups)
        ]

    @property
    def num_blocks(self) -> int:
        """Blocks a request can hold: the pool's, less the null block."""
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def max_tokens_per_request(self) -> int | None:
        """The longest sequence whose blocks in every group fit the pool at once, whichever
        step it is in."""
        fits = 0
        low, high = 0, self.num_blocks * self.block_size
        while low <= high:  # blocks_for_tokens never shrinks as the length grows
            mid = (low + high) // 2
            if self.blocks_for_tokens(mid) <= self.num_blocks:
                fits, low = mid, mid + 1
            else:
                high = mid - 1
        return fits

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """The most blocks of all groups a sequence of `num_tokens` holds at any step."""
        chunk = num_tokens if self.max_chunk_tokens is None else self.max_chunk_tokens
        return blocks_for_tokens(self.kv_groups, self.block_size, num_tokens, chunk)

    def block_ids(self, request_id: str) -> list[int]:
        """The first group's table (a full-attention group's where the model has one)."""
        return self.groups[0].block_ids(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [group.block_ids(request_id) for group in self.groups]

    def num_blocks_held(self, request_id: str) -> int:
        return sum(group.num_blocks_held(request_id) for group in self.groups)

    def find_cached_prefix(self, request: Request) -> GroupedBlocks:
        length = (request.num_tokens - 1) // self.block_size
        full_hits: dict[int, list[KVBlock]] = {}
        for g, group in enumerate(self.groups):
            if group.window is None:
                full_hits[g] = group.find_cached_prefix(request, length)
                length = len(full_hits[g])
        found: dict[int, dict[int, KVBlock | None]] = {
            g: {} for g, group in enumerate(self.groups) if group.window is not None
        }
        length = self._window_hit_length(request, length, found)
        per_group: list[list[KVBlock]] = []
        for g, group in enumerate(self.groups):
            if g in full_hits:
                per_group.append(full_hits[g][:length])
                continue
            first = group.first_read_block(length * self.block_size)
            live = [found[g][i] for i in range(first, length)]
            per_group.append([self.null_block] * first + live)  # type: ignore[list-item]
        return GroupedBlocks(per_group)

    def _window_hit_length(
        self, request: Request, length: int, found: dict[int, dict[int, KVBlock | None]]
    ) -> int:
        """The longest hit of at most `length` blocks whose window every sliding group holds.
        Looked up from the window's end backwards (`found` keeps each answer): a block i
        missing rules out every length above i whose window reaches back to it, so the next
        candidate is i itself, and a disk file is read only for windows still in question."""
        while length > 0:
            missing = None
            for g, seen in found.items():
                group = self.groups[g]
                for i in reversed(range(group.first_read_block(length * self.block_size), length)):
                    if i not in seen:
                        seen[i] = group.cached_block(request, i)
                    if seen[i] is None:
                        missing = i
                        break
                if missing is not None:
                    break
            if missing is None:
                return length
            length = missing
        return 0

    def shared_prompt(self, parent: Request, num_tokens: int) -> GroupedBlocks:
        """The parent's blocks of its first `num_tokens` tokens in every group; empty when a
        sliding group has already given back one that a sibling starting there still reads."""
        per_group = [group.shared_prompt(parent, num_tokens) for group in self.groups]
        for group, blocks in zip(self.groups, per_group, strict=True):
            if self.null_block in blocks[group.first_read_block(num_tokens) :]:
                return GroupedBlocks([[] for _ in self.groups])
        return GroupedBlocks(per_group)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> bool:
        taken_over = getattr(cached_prefix, "per_group", None) or [[] for _ in self.groups]
        for group in self.groups:
            group.drop_unread_blocks(request)
        plans = [
            group.plan_slots(request, num_new_tokens, blocks)
            for group, blocks in zip(self.groups, taken_over, strict=True)
        ]
        if sum(plan.num_free_needed for plan in plans) > self.pool.num_free_blocks:
            return False
        for group, plan in zip(self.groups, plans, strict=True):
            group.acquire_taken_over(plan)
        for group, plan in zip(self.groups, plans, strict=True):
            group.commit_slots(request, plan)
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        return [pair for group in self.groups for pair in group.take_block_copies()]

    def take_tier_transfers(self) -> tuple[list[EvictedBlock], list[tuple[BlockHash, int]]]:
        return self.tiers.take_transfers()

    def blocks_to_persist(self) -> list[EvictedBlock]:
        return self.tiers.blocks_to_persist()

    def expire(self) -> None:
        self.tiers.expire()

    def trim(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.trim(request, num_tokens)

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)
