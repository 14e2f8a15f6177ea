"""Prompt lookup: draft what followed the last time the request's latest tokens appeared.

Free to run (no model), and strong wherever the output repeats its input: rewriting, editing
or summarising a given passage, code changes, extraction. The request's own tokens (prompt and
output) are searched for the most recent earlier occurrence of its last n tokens, n from
`max_n` down to `min_n`; the tokens after that occurrence are the drafts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.scheduler_output import ScheduledRequest


def propose_ngram(token_ids: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier match of the longest suffix
    (of `max_n` down to `min_n` tokens) of `token_ids`; [] when no suffix recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # Windows starting before the suffix itself, so something follows each match.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n
            return tokens[start : start + num_drafts].tolist()
    return []


class NgramProposer:
    own_kv_caches: tuple[()] = ()  # drafts from the token ids alone

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self,
        scheduled: Sequence[ScheduledRequest],
        emitted: Mapping[str, list[int]],
        hidden: torch.Tensor,
    ) -> dict[str, list[int]]:
        proposals = {}
        for item in scheduled:
            new_tokens = emitted.get(item.request.request_id)
            if item.num_tokens_to_draft and new_tokens:
                history = [*item.request.all_token_ids, *new_tokens]
                drafts = propose_ngram(history, item.num_tokens_to_draft, self.min_n, self.max_n)
                if drafts:
                    proposals[item.request.request_id] = drafts
        return proposals

    def draft_probs(self, request_id: str, draft_token_ids: Sequence[int]) -> None:
        """Lookup drafts are deterministic."""
        return None

    def draft_parents(self, request_id: str) -> None:
        """Its drafts are chains."""
        return None
