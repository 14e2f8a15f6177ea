"""A step's token bitmask: filled for every constrained row in batched xgrammar calls, optionally
in a background thread while the model's forward pass runs, then applied to the logits at once.

Which tokens a row allows depends only on its matcher and the drafts before it, both known when
the step is scheduled, so the fill need not wait for the logits. One bitmask buffer, grown to
the most rows a step has had, serves every step (steps never overlap). Drafts are filled level by
level: all requests' row 0, then each request accepts its draft 0 tentatively and fills row 1,
and so on; the matchers are rolled back afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from tokenmill.kernels import ops


@dataclass
class MaskRows:
    """One request's rows of the step: its row `first_row`, then one row per draft."""

    matcher: xgr.GrammarMatcher
    drafts: Sequence[int]
    first_row: int
    num_tentative: int = 0  # drafts accepted while filling, rolled back after


@dataclass(frozen=True)
class FilledRows:
    rows: list[int]
    fill_s: float  # the fill's own time


@dataclass
class PendingMask:
    """A fill under way, or done."""

    filled: Future[FilledRows]


class TokenBitmask:
    def __init__(self, vocab_size: int, background: bool) -> None:
        """`vocab_size`: the logits' width. `background`: fill in a worker thread (the forward
        pass runs meanwhile); False fills in the caller's thread, the baseline."""
        self._vocab_size = vocab_size
        self._buffer = xgr.allocate_token_bitmask(1, vocab_size)
        self._batch = xgr.BatchGrammarMatcher()
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-mask")
            if background
            else None
        )

    def start(self, requests: list[MaskRows], num_rows: int) -> PendingMask:
        """Begin filling the rows of `requests` in a bitmask of `num_rows` rows."""
        if self._buffer.shape[0] < num_rows:
            self._buffer = xgr.allocate_token_bitmask(num_rows, self._vocab_size)
        if self._worker is not None:
            return PendingMask(self._worker.submit(self._fill, requests))
        filled: Future[FilledRows] = Future()
        filled.set_result(self._fill(requests))
        return PendingMask(filled)

    def apply(self, pending: PendingMask, logits: torch.Tensor) -> FilledRows:
        """Wait for `pending`, then mask its rows of `logits` in place."""
        filled = pending.filled.result()
        if filled.rows:
            rows = torch.tensor(filled.rows, dtype=torch.long)
            ops.apply_token_bitmask(logits, self._buffer, rows)
        return filled

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _fill(self, requests: list[MaskRows]) -> FilledRows:
        """Fill the rows level by level; returns the rows filled. A request stops at a draft its
        grammar refuses (verification rejects it, so the rows after it are never used) or once
        its grammar has ended."""
        start = time.perf_counter()
        filled: list[int] = []
        level = [r for r in requests if not r.matcher.is_terminated()]
        depth = 0
        while level:
            indices = [r.first_row + depth for r in level]
            self._batch.batch_fill_next_token_bitmask(
                [r.matcher for r in level], self._buffer, indices
            )
            filled += indices
            drafting = [r for r in level if depth < len(r.drafts)]
            if not drafting:
                break
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(
                [r.matcher for r in drafting], [r.drafts[depth] for r in drafting]
            )
            level = []
            for request, ok in zip(drafting, accepted, strict=True):
                if ok:
                    request.num_tentative += 1
                    if not request.matcher.is_terminated():
                        level.append(request)
            depth += 1
        for request in requests:
            if request.num_tentative:
                request.matcher.rollback(request.num_tentative)
        return FilledRows(filled, time.perf_counter() - start)
