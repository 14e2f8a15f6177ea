"""What the runner asks of a drafter once a step's tokens are known: drafts for the next step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from tokenmill.kv.quantized import KVCache
from tokenmill.scheduler_output import ScheduledRequest


class Proposer(Protocol):
    own_kv_caches: Sequence[KVCache]
    """The drafter's own paged KV (a draft model's, an EAGLE head's), addressed through the
    target's block ids: a block copied on write is copied there too."""

    def propose(
        self,
        scheduled: Sequence[ScheduledRequest],
        emitted: Mapping[str, list[int]],
        hidden: torch.Tensor,
    ) -> dict[str, list[int]]:
        """Drafts for each request with `num_tokens_to_draft > 0` (up to that many), given the
        tokens every request gained this step (`emitted`, not yet appended to the request)
        and the target's final hidden states of the step's flat batch. Called every step with
        the whole batch, so a drafter with its own KV can follow the target token by token."""
        ...

    def draft_probs(self, request_id: str, draft_token_ids: Sequence[int]) -> torch.Tensor | None:
        """The distributions the request's drafts `draft_token_ids` (from the last `propose`)
        were drawn from, `[len(draft_token_ids), vocab]`; None for drafts chosen
        deterministically, which the rejection sampler treats as one-hot."""
        ...

    def draft_parents(self, request_id: str) -> list[int] | None:
        """The tree of the request's drafts from the last `propose` (tokenmill/draft_tree.py);
        None for a chain. The runner moves an accepted path's target KV and features into
        chain order, not a drafter's KV: a drafter with KV of its own (EAGLE) recomputes its
        KV at the path's positions from those features in its next catch-up."""
        ...


def num_computed_after(item: ScheduledRequest, gained: Sequence[int]) -> int:
    """The request's positions with valid target KV once the step is done: up to, not
    including, the newest token it gained (drafts rejected past it are stale); all the chunk
    computed when it gained none."""
    if gained:
        return item.request.num_tokens + len(gained) - 1
    return item.num_computed_tokens + item.num_new_tokens


def token_ids_between(
    item: ScheduledRequest, gained: Sequence[int], start: int, end: int
) -> list[int]:
    """Tokens at positions [start, end) of the request with this step's gained tokens added
    (they are appended only after the proposer ran)."""
    known = item.request.num_tokens
    return item.request.all_token_ids[start:end] + list(
        gained[max(start - known, 0) : max(end - known, 0)]
    )
