"""`kv_cache="paged"`: block tables of the running requests over one BlockPool, blocks taken
as tokens arrive, and prefix-cache reuse.

Several requests may hold one block: cached prefix blocks, and the prompt blocks an n > 1
sibling forks from its parent, the last of which may be partial. Before a request writes a slot
in a block somebody else also holds, `allocate_slots` gives it a private copy (copy-on-write):
the block table points at a fresh block and `(src, dst)` is recorded for the runner to copy
before the step's forward pass.

One manager may also serve as one KV-cache group of a hybrid model (tokenmill/kv/hybrid.py):
it then shares its pool with the other groups, tags its prefix-cache hashes with the group, and
with a sliding `window` replaces each block no later query reads by the pool's null block.

Prefix lookups go through the pool's `CacheTiers` (kv/tiers.py): the pool's cached blocks, then
the disk tier's (`DiskBlock`s, loaded into fresh blocks when taken over); the saves and loads a
step owes the disk tier are collected there too. Retention and the prefix-cache TTL live in
the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenmill.kv.block_pool import BlockHash, BlockPool, EvictedBlock, KVBlock, hash_block
from tokenmill.kv.disk_tier import DiskTier
from tokenmill.kv.kv_manager import KVCacheManager
from tokenmill.kv.tiers import CacheTiers
from tokenmill.request import Request


@dataclass(frozen=True)
class SlotPlan:
    """One `allocate_slots` call worked out: the table it starts from (the request's own
    blocks, then the cached ones it takes over) and what it needs from the pool."""

    held: list[KVBlock]
    num_owned: int  # leading blocks of `held` the request holds already
    num_new_blocks: int
    shared_written: list[int]  # indices of shared blocks this step writes: copied first
    num_free_needed: int  # new blocks, copies, and cached blocks taken back from the free queue
    num_tokens_after: int


class PagedKVManager(KVCacheManager):
    shares_blocks = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_ttl_s: float | None = None,
        max_retained_fraction: float = 0.5,
        clock: Callable[[], float] = time.time,
        disk_tier: DiskTier | None = None,
        tiers: CacheTiers | None = None,
        window: int | None = None,
        null_block: KVBlock | None = None,
        hash_tag: bytes = b"",
    ) -> None:
        """`cache_ttl_s`, `max_retained_fraction`, `clock`: see BlockPool's TTL and retention;
        `disk_tier`: where evicted cached blocks go, and prefix lookups continue.
        `tiers`, `window`, `null_block` and `hash_tag` only for a group of a hybrid manager:
        the shared pool's tiers (replacing the arguments before), the group's sliding window,
        the block standing in for dropped ones (never read), and the bytes that keep the
        group's prefix-cache entries (and disk files) its own."""
        self.block_size = block_size
        self.tiers = tiers or CacheTiers(
            BlockPool(
                num_blocks,
                enable_caching=enable_prefix_caching,
                cache_ttl_s=cache_ttl_s,
                max_retained_blocks=int(max_retained_fraction * num_blocks),
                clock=clock,
                record_evictions=disk_tier is not None,
            ),
            disk_tier,
        )
        self.pool = self.tiers.pool
        self.window = window
        self.null_block = null_block
        self.hash_tag = hash_tag
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks already in the prefix cache
        self._block_copies: list[tuple[int, int]] = []  # (src, dst) owed by this step's writes

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return sum(block is not self.null_block for block in self._tables.get(request_id, ()))

    @property
    def disk_tier(self) -> DiskTier | None:
        return self.tiers.disk_tier

    def find_cached_prefix(self, request: Request, max_blocks: int | None = None) -> list[KVBlock]:
        """The longest run of leading blocks in the pool or on disk (at most `max_blocks`)."""
        stop = (request.num_tokens - 1) // self.block_size
        if max_blocks is not None:
            stop = min(stop, max_blocks)
        hits: list[KVBlock] = []
        for i in range(stop):
            block = self.cached_block(request, i)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_block(self, request: Request, index: int) -> KVBlock | None:
        """The request's block `index` from the prefix cache's tiers, None where missing."""
        self._extend_block_hashes(request, index + 1)
        tokens = request.all_token_ids[index * self.block_size : (index + 1) * self.block_size]
        return self.tiers.lookup(request.block_hashes[index] + self.hash_tag, tokens)

    def first_read_block(self, num_computed: int) -> int:
        """The first block a query starting at position `num_computed` (and every later one)
        reads: with a window w, position p attends to [p - w + 1, p], so blocks wholly before
        `num_computed - w + 1` are never read again."""
        if self.window is None:
            return 0
        return max(num_computed - self.window + 1, 0) // self.block_size

    def shared_prompt(self, parent: Request, num_tokens: int) -> list[KVBlock]:
        """The parent's blocks holding its first `num_tokens` tokens, for a sibling to take over
        through `allocate_slots`; the last may be partial, and is copied on its first write."""
        return self._tables[parent.request_id][: -(-num_tokens // self.block_size)]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for `num_new_tokens` after the request's computed tokens, which include
        the `cached_prefix` blocks a new request is about to take over. A shared block the new
        tokens land in is replaced by a private copy (see `take_block_copies`)."""
        self.drop_unread_blocks(request)
        if not cached_prefix and self._fits_held_blocks(request, num_new_tokens):
            num_after = request.num_computed_tokens + num_new_tokens
            self._publish_full_blocks(request, self._tables[request.request_id], num_after)
            return True
        plan = self.plan_slots(request, num_new_tokens, cached_prefix)
        if plan.num_free_needed > self.pool.num_free_blocks:
            return False
        self.acquire_taken_over(plan)
        self.commit_slots(request, plan)
        return True

    def _fits_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the new tokens land in blocks the request already holds alone (a decode's,
        most steps): then a plan would take nothing from the pool and copy nothing."""
        table = self._tables.get(request.request_id)
        if table is None:
            return False
        num_after = request.num_computed_tokens + num_new_tokens
        return self._blocks_spanned(num_after) <= len(table) and not self._shared_blocks_written(
            table, len(table), request, num_after
        )

    def drop_unread_blocks(self, request: Request) -> None:
        """With a window: give the blocks no later query of the request reads back to the pool,
        their table entries becoming the null block."""
        table = self._tables.get(request.request_id)
        if table is None or self.window is None:
            return
        stop = min(self.first_read_block(request.num_computed_tokens), len(table))
        dropped = [block for block in table[:stop] if block is not self.null_block]
        if dropped:
            assert self.null_block is not None
            table[:stop] = [self.null_block] * stop
            self._release(dropped)

    def plan_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> SlotPlan:
        """What `allocate_slots` would take from the pool, without taking it."""
        table = self._tables.get(request.request_id, [])
        num_after = request.num_computed_tokens + num_new_tokens
        held = [*table, *cached_prefix]
        needed = max(self._blocks_spanned(num_after) - len(held), 0)
        revived = sum(1 for block in self._real(cached_prefix) if block.ref_count == 0)
        shared = self._shared_blocks_written(held, len(table), request, num_after)
        return SlotPlan(held, len(table), needed, shared, needed + len(shared) + revived, num_after)

    def acquire_taken_over(self, plan: SlotPlan) -> None:
        """The first half of carrying out a plan: reference the cached pool blocks it takes
        over, before any allocation (of this group's or another's) can evict them."""
        self.tiers.acquire(self._real(plan.held[plan.num_owned :]))

    def commit_slots(self, request: Request, plan: SlotPlan) -> None:
        """Carry out the rest of a plan whose `num_free_needed` blocks are free."""
        taken_over = self.tiers.load_from_disk(plan.held[plan.num_owned :])
        held = [*plan.held[: plan.num_owned], *taken_over]
        table = [*held, *self.pool.allocate(plan.num_new_blocks)]
        for index in plan.shared_written:
            table[index] = self._copy_on_write(table[index])
        self._tables[request.request_id] = table
        self._publish_full_blocks(request, table, plan.num_tokens_after)

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._block_copies = self._block_copies, []
        return copies

    def take_tier_transfers(self) -> tuple[list[EvictedBlock], list[tuple[BlockHash, int]]]:
        return self.tiers.take_transfers()

    def blocks_to_persist(self) -> list[EvictedBlock]:
        return self.tiers.blocks_to_persist()

    def expire(self) -> None:
        self.tiers.expire()

    def trim(self, request: Request, num_tokens: int) -> None:
        """Never below the span reserved at admission."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        keep = self._blocks_spanned(num_tokens)
        if keep < len(table):
            self._release(table[keep:])
            del table[keep:]

    def _blocks_spanned(self, num_tokens: int) -> int:
        """Blocks a request's table holds for `num_tokens`: never fewer than its reserved span."""
        span = max(num_tokens, self._reserved_tokens())
        return -(-span // self.block_size)

    def _reserved_tokens(self) -> int:
        """Slots every request holds from admission on, however few it has computed."""
        return 0

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        if request.params.cache_ttl is not None:
            prompt_blocks = self._real(table[: request.num_prompt_tokens // self.block_size])
            self.pool.retain(prompt_blocks, self.pool.clock() + request.params.cache_ttl)
        self._release(table)

    def _release(self, blocks: list[KVBlock]) -> None:
        """Drop the references tail-first. A pending copy into a block that goes free (its
        owner was preempted in the step that copied it) is cancelled: nobody needs it, and the
        block may be handed out again, even as another copy's destination, before it runs."""
        blocks = self._real(blocks)
        self.pool.release(reversed(blocks))
        if self._block_copies:
            freed = {block.block_id for block in blocks if block.ref_count == 0}
            self._block_copies = [pair for pair in self._block_copies if pair[1] not in freed]

    def _real(self, blocks: Sequence[KVBlock]) -> list[KVBlock]:
        """The blocks but the null block, which nobody takes or releases."""
        return [block for block in blocks if block is not self.null_block]

    def _shared_blocks_written(
        self, held: list[KVBlock], num_owned: int, request: Request, num_after: int
    ) -> list[int]:
        """Indices of the blocks that slots [num_computed_tokens, num_after) fall in and that
        another request also holds (counting the reference a taken-over block is about to get)."""
        if num_after <= request.num_computed_tokens:
            return []
        first = request.num_computed_tokens // self.block_size
        stop = min(-(-num_after // self.block_size), len(held))
        return [i for i in range(first, stop) if held[i].ref_count + (i >= num_owned) > 1]

    def _copy_on_write(self, block: KVBlock) -> KVBlock:
        (fresh,) = self.pool.allocate(1)
        self._block_copies.append((block.block_id, fresh.block_id))
        self.pool.release([block])
        return fresh

    def _publish_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        """Cache the blocks this step fills: their token ids are known before the forward pass
        writes their KV, and a same-step reader attends only after every write of its layer."""
        if not self.pool.enable_caching:
            return
        full = min(num_tokens, request.num_tokens) // self.block_size
        self._extend_block_hashes(request, full)
        start = self._num_published.get(request.request_id, 0)
        for i in range(start, full):
            if table[i] is self.null_block:
                continue
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.tiers.cache(table[i], request.block_hashes[i] + self.hash_tag, tokens)
        self._num_published[request.request_id] = max(start, full)

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            start = i * self.block_size
            hashes.append(
                hash_block(parent, request.all_token_ids[start : start + self.block_size])
            )
