"""The one interface the scheduler allocates KV through, whatever the cache mode.

`allocate_slots` is the single question the scheduler asks: can this request add N tokens to
its KV? False means "preempt somebody first". Three implementations answer it: `paged` (blocks
taken as tokens arrive, prefix caching, copy-on-write sharing), `contiguous` (a whole
max-length span reserved up front, the baseline paged attention is measured against) and
`none` (nothing kept: every step recomputes each whole sequence). The scheduler asks what a
mode can do through the two capabilities below, never which mode it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tokenmill.kv.block_pool import BlockHash, EvictedBlock, KVBlock
from tokenmill.request import Request


class KVCacheManager(ABC):
    block_size: int
    holds_kv: bool = True
    """False: no KV survives a step, so each step computes every sequence from its start (and a
    prompt cannot be split into chunks)."""
    shares_blocks: bool = False
    """True: an n > 1 sibling can take over its parent's prompt blocks (`shared_prompt`)."""

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (cached blocks with no reader count as free)."""

    @property
    def max_tokens_per_request(self) -> int | None:
        """The longest sequence the pool could ever hold (None: no limit); a longer one would
        preempt itself forever."""
        return self.num_blocks * self.block_size

    @abstractmethod
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (of its first KV-cache group, where there are several)."""

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """One block table per KV-cache group (tokenmill/kv/groups.py), in group order."""
        return [self.block_ids(request_id)]

    @abstractmethod
    def num_blocks_held(self, request_id: str) -> int: ...

    @abstractmethod
    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of the request's leading full blocks already cached; never its last
        token, whose logits the next token is sampled from."""

    def shared_prompt(self, parent: Request, num_tokens: int) -> list[KVBlock]:
        """The parent's blocks holding its first `num_tokens` tokens, for a sibling to take
        over through `allocate_slots` (only where `shares_blocks`); empty when the parent no
        longer holds all that a sibling would read."""
        raise NotImplementedError(f"{type(self).__name__} does not share blocks")

    @abstractmethod
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for `num_new_tokens` after the request's computed tokens (which include the
        `cached_prefix` a new request is about to take over); False when the pool is short."""

    @abstractmethod
    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies this step's writes need, in order; clears the list."""

    def take_tier_transfers(self) -> tuple[list[EvictedBlock], list[tuple[BlockHash, int]]]:
        """The evicted cached blocks whose KV to save to the disk tier before this step's
        writes, and the (block hash, block id) loads from it; clears both. None by default."""
        return [], []

    def blocks_to_persist(self) -> list[EvictedBlock]:
        """Cached blocks not yet in the disk tier, saved on a clean shutdown. None by default."""
        return []

    def expire(self) -> None:
        """Drop cached blocks past their TTL and end retentions that ran out (once a step).
        Nothing to do by default."""
        return None

    @abstractmethod
    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the slots past the first `num_tokens` (rejected drafts' stale KV)."""

    @abstractmethod
    def free(self, request: Request) -> None: ...
