"""The structured-output state of the engine's requests: one grammar matcher per sequence.

The engine owns one StructuredOutputManager. A constrained request's grammar is compiled off the
step loop (compiler.py); once it is ready the request gets a matcher, which follows the request's
accepted output tokens only: drafts are accepted tentatively to fill their rows' masks and rolled
back at once, and a preempted request keeps its matcher because its output tokens stay. Each
step the runner starts the constrained rows' token bitmask before its forward pass (bitmask.py:
filled in the background meanwhile, by default) and applies it to their logits after.

xgrammar (which imports transformers) is imported on the first constrained request, so an
engine that never sees one starts as fast as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.request import Request
from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.scheduler_output import ScheduledRequest

if TYPE_CHECKING:
    import xgrammar as xgr

    from tokenmill.structured.bitmask import MaskRows, PendingMask, TokenBitmask
    from tokenmill.structured.compiler import GrammarCompiler


@dataclass
class StructuredState:
    """One sequence's matcher and how many of its output tokens the matcher has consumed."""

    matcher: xgr.GrammarMatcher
    num_accepted: int = 0


@dataclass
class StructuredStats:
    """Cumulative cost of constraining, for benchmarks: the steps that masked any row; the time
    the step loop spent on their masks (filling them in its own thread, or waiting for the
    background fill, and applying them); the fills' own time, wherever they ran; and the time
    spent advancing matchers."""

    num_masked_steps: int = 0
    num_masked_rows: int = 0
    mask_time_s: float = 0.0
    fill_time_s: float = 0.0
    accept_time_s: float = 0.0


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, overlap_grammar_masks: bool = True
    ) -> None:
        """`vocab_size`: the width of the model's logits (it may exceed the tokenizer's).
        `overlap_grammar_masks`: fill a step's token bitmask in a background thread while the
        forward pass runs; False fills it in the step loop, the baseline."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._overlap = overlap_grammar_masks
        self._compiler: GrammarCompiler | None = None  # built on first use: the vocab costs time
        self._compiler_lock = threading.Lock()
        self._bitmask: TokenBitmask | None = None  # built with the first matcher
        self._pending: PendingMask | None = None  # the step's fill, until its mask is applied
        self._states: dict[str, StructuredState] = {}
        self.stats = StructuredStats()

    def compile(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """Start compiling `spec` (or find it compiled); safe to call from any thread."""
        with self._compiler_lock:
            if self._compiler is None:
                from tokenmill.structured.compiler import GrammarCompiler
                from tokenmill.structured.vocab import tokenizer_info

                info = tokenizer_info(self._tokenizer, self._vocab_size)
                self._compiler = GrammarCompiler(info)
        return self._compiler.compile(spec)

    def start(self, request: Request, grammar: xgr.CompiledGrammar) -> None:
        """Give `request` its matcher; its output so far (none, normally) is fed to it."""
        import xgrammar as xgr

        from tokenmill.structured.bitmask import TokenBitmask

        if self._bitmask is None:
            self._bitmask = TokenBitmask(self._vocab_size, background=self._overlap)
        state = StructuredState(xgr.GrammarMatcher(grammar))
        self._states[request.request_id] = state
        self._advance(state, request.output_token_ids)

    def constrains(self, request_id: str) -> bool:
        return request_id in self._states

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
        if self._bitmask is not None:
            self._bitmask.shutdown()

    def start_masks(self, sampling: Sequence[ScheduledRequest]) -> None:
        """Begin filling this step's token bitmask. The rows are those of the step's logits:
        1 + k per request of `sampling` (k drafts); row i of a request follows its drafts
        0..i-1, accepted tentatively. Until `apply_masks`, the matchers are not to be touched."""
        self._drop_unapplied_fill()
        if self._bitmask is None or not self._states:
            return
        from tokenmill.structured.bitmask import MaskRows

        start = time.perf_counter()
        requests: list[MaskRows] = []
        row = 0
        for item in sampling:
            state = self._states.get(item.request.request_id)
            if state is not None:
                requests.append(MaskRows(state.matcher, item.spec_token_ids, row))
            row += 1 + len(item.spec_token_ids)
        if requests:
            self._pending = self._bitmask.start(requests, row)
        self.stats.mask_time_s += time.perf_counter() - start

    def apply_masks(self, logits: torch.Tensor) -> None:
        """Forbid, in place, what each constrained row's grammar does not allow next (the rows
        `start_masks` began filling); waits for the fill if it is still running."""
        if self._pending is None:
            return
        assert self._bitmask is not None
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        filled = self._bitmask.apply(pending, logits)
        self.stats.num_masked_steps += 1
        self.stats.num_masked_rows += len(filled.rows)
        self.stats.fill_time_s += filled.fill_s
        self.stats.mask_time_s += time.perf_counter() - start

    def mask_logits(self, sampling: Sequence[ScheduledRequest], logits: torch.Tensor) -> None:
        """`start_masks` and `apply_masks` at once."""
        self.start_masks(sampling)
        self.apply_masks(logits)

    def accept(self, requests: Sequence[Request]) -> list[Request]:
        """Advance each constrained request's matcher over its new output tokens; returns the
        unfinished requests whose grammar has now ended (complete, or refusing a token)."""
        self._drop_unapplied_fill()
        start = time.perf_counter()
        ended = []
        for request in requests:
            state = self._states.get(request.request_id)
            if state is None:
                continue
            if request.is_finished:
                self.release(request.request_id)
            elif not self._advance(state, request.output_token_ids):
                ended.append(request)
        self.stats.accept_time_s += time.perf_counter() - start
        return ended

    @staticmethod
    def _advance(state: StructuredState, output_token_ids: Sequence[int]) -> bool:
        """Feed the matcher the tokens it has not seen; False once the grammar has ended."""
        matcher = state.matcher
        for token in output_token_ids[state.num_accepted :]:
            state.num_accepted += 1
            if matcher.is_terminated() or not matcher.accept_token(token):
                return False
        return not matcher.is_terminated()

    def _drop_unapplied_fill(self) -> None:
        """A step that failed between `start_masks` and `apply_masks` leaves its fill behind:
        wait for it (it moves matchers tentatively) and forget it."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.filled.exception()
