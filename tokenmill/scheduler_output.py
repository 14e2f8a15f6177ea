"""What one scheduling step hands the runner: which requests compute how many tokens, in which
blocks. Plain data that the engine, the runner and the proposers all read; no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.request import Request


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block the KV pool is about to reuse: its KV is still in `block_id`'s slots, to
    be saved to the disk tier under its chained hash."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    last_used: float  # clock time its last holder let it go
    retained_until: float | None = None  # a request asked for it to be kept until then


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # positions computed this step, drafts included
    num_computed_tokens: int  # before this step
    block_ids: list[int]  # the first KV-cache group's table (the one a proposer's own KV uses)
    spec_token_ids: tuple[int, ...] = ()  # drafts verified after the request's last token
    num_tokens_to_draft: int = 0  # drafts to propose once this step's new tokens are known
    group_block_ids: tuple[list[int], ...] = ()  # every group's table; () when one group
    spec_parents: tuple[int, ...] = ()  # the drafts' tree (tokenmill/draft_tree.py); (): chain

    @property
    def block_tables(self) -> tuple[list[int], ...]:
        """One block table per KV-cache group."""
        return self.group_block_ids or (self.block_ids,)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new one is sampled."""
        num_known = self.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
        return num_known == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    # The disk tier's transfers, done before the copies: evicted blocks to save, then
    # (block hash, block id) loads.
    kv_saves: list[EvictedBlock] = field(default_factory=list)
    kv_loads: list[tuple[bytes, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
