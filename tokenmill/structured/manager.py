"""The structured-output state of the engine's requests: one grammar matcher per sequence.

The engine owns one StructuredOutputManager. A constrained request's grammar is compiled off the
step loop (compiler.py); once it is ready the request gets a matcher, which follows the request's
accepted output tokens only: drafts are accepted tentatively to fill their rows' masks and rolled
back at once, and a preempted request keeps its matcher because its output tokens stay. Each
step the runner asks for the constrained rows' token bitmask and applies it to their logits.

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

    from tokenmill.structured.compiler import GrammarCompiler


@dataclass
class StructuredState:
    """One sequence's matcher and how many of its output tokens the matcher has consumed."""

    matcher: xgr.GrammarMatcher
    num_accepted: int = 0


@dataclass
class StructuredStats:
    """Cumulative cost of constraining, for benchmarks: the steps that masked any row, the time
    spent filling and applying their masks, and the time spent advancing matchers."""

    num_masked_steps: int = 0
    num_masked_rows: int = 0
    mask_time_s: float = 0.0
    accept_time_s: float = 0.0


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """`vocab_size`: the width of the model's logits (it may exceed the tokenizer's)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None  # built on first use: the vocab costs time
        self._compiler_lock = threading.Lock()
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

    def mask_logits(self, sampling: Sequence[ScheduledRequest], logits: torch.Tensor) -> None:
        """Forbid, in place, what each constrained row's grammar does not allow next. `logits`
        holds 1 + k rows per request of `sampling` (k drafts): row i of a request follows its
        drafts 0..i-1, accepted tentatively and rolled back afterwards."""
        constrained = [item for item in sampling if item.request.request_id in self._states]
        if not constrained:
            return
        start = time.perf_counter()
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
        rows: list[int] = []
        row = 0
        for item in sampling:
            state = self._states.get(item.request.request_id)
            if state is not None:
                rows += self._fill_rows(state.matcher, item.spec_token_ids, bitmask, row)
            row += 1 + len(item.spec_token_ids)
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        self.stats.num_masked_steps += 1
        self.stats.num_masked_rows += len(rows)
        self.stats.mask_time_s += time.perf_counter() - start

    def accept(self, requests: Sequence[Request]) -> list[Request]:
        """Advance each constrained request's matcher over its new output tokens; returns the
        unfinished requests whose grammar has now ended (complete, or refusing a token)."""
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

    @staticmethod
    def _fill_rows(
        matcher: xgr.GrammarMatcher, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int
    ) -> list[int]:
        """Fill the bitmask rows of one request; returns the rows filled. Rows after a draft the
        grammar refuses stay unmasked: verification rejects that draft, so they are never used."""
        filled: list[int] = []
        num_tentative = 0
        for i in range(len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, first_row + i)
            filled.append(first_row + i)
            if i == len(drafts) or not matcher.accept_token(drafts[i]):
                break
            num_tentative += 1
        if num_tentative:
            matcher.rollback(num_tentative)
        return filled
