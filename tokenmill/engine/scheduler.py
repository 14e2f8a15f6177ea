"""Iteration-level scheduling: each step, hand out a token budget across requests.

Running requests go first (a decode costs one token, an unfinished prompt a chunk), then
waiting requests are admitted by (priority, arrival) while budget, sequence slots and KV blocks
last. When a running request cannot get a block, the least important running request (highest
priority value, then latest arrival) is preempted: its blocks are freed and it waits to be
recomputed, which the prefix cache usually makes cheap. The scheduler never sees a tensor.

With speculative decoding, a chunk that reaches a request's last token also carries the drafts
proposed after the previous step; the runner verifies them, and `update` keeps the accepted
ones and rolls the rest back. Slots for drafts are only taken when the pool has room for them:
speculation never preempts anybody.

The n samples of one prompt compute it once. The first child (the parent) is admitted like any
request; each sibling waits, without holding up the queue behind it, until the parent has
computed all of the prompt but its last token, then forks: it takes references on the parent's
blocks holding those tokens, the partial last one included, and starts with them computed. It
then computes the last prompt token itself, as a one-token step: its first sample needs that
position's logits, and recomputing them costs one decode token where sharing the parent's logits
row would make the runner sample one row for several requests. That write lands in the shared
partial block, so the KV manager copies the block first (copy-on-write) and the step's
`block_copies` tell the runner to copy its KV. Siblings fork only under continuous batching with
a paged cache; otherwise they compute the prompt like any request (prefix-cache hits included).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.engine.request import FinishReason, Request, RequestStatus
from tokenmill.kv.block_pool import KVBlock
from tokenmill.kv.kv_manager import KVCacheManager
from tokenmill.spec.policy import SpeculationPolicy


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # positions computed this step, drafts included
    num_computed_tokens: int  # before this step
    block_ids: list[int]
    spec_token_ids: tuple[int, ...] = ()  # drafts verified after the request's last token
    num_tokens_to_draft: int = 0  # drafts to propose once this step's new tokens are known

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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens_cached: int = 0
    num_prompt_tokens_queried: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    spec_draft_time_s: float = 0.0  # proposer time, charged by the engine
    spec_verify_time_s: float = 0.0  # time of the steps that verified drafts


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        static_batching: bool = False,
        speculation: SpeculationPolicy | None = None,
    ) -> None:
        """`kv_manager=None` means no KV cache: every step recomputes each whole sequence."""
        self.kv = kv_manager
        self.speculation = speculation
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.static_batching = static_batching
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (priority, order, request)
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.stats = SchedulerStats()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission, preempted ones included."""
        return len(self._waiting)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_order = next(self._arrivals)
        if self.speculation is not None:
            request.num_speculative_tokens = self.speculation.num_speculative_tokens
        self._requests[request.request_id] = request
        self._push_waiting(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.static_batching and not self.running:
            self._admit_static_batch()
        budget = self.max_num_batched_tokens
        # The batch this step will run: the running requests and those about to be admitted.
        batch_size = min(len(self._requests), self.max_num_seqs)
        speculate = self.speculation is not None and self.speculation.enabled_for(batch_size)
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = self._tokens_to_compute(request, budget)
            if num_new == 0:
                continue
            plan = self._plan_speculation(request, num_new, budget, speculate)
            extra = self._extra_slots(plan)
            if extra and not self.kv.allocate_slots(request, num_new + extra):
                plan, extra = _NO_SPECULATION, 0
            if not extra and not self._allocate_or_preempt(request, num_new, out):
                continue
            budget -= num_new + len(plan.drafts)
            out.scheduled.append(self._scheduled(request, num_new, plan))
        if not out.preempted and not self.static_batching:
            self._admit_waiting(budget, out, speculate)
        if self.kv is not None:
            out.block_copies = self.kv.take_block_copies()
        return out

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        proposed: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Record the step's progress and new tokens (several when drafts were accepted), and
        the drafts proposed for the next step; returns the requests that finished."""
        finished = []
        now = time.monotonic()
        for item in out.scheduled:
            request = item.request
            tokens = sampled.get(request.request_id, [])
            num_rejected = len(item.spec_token_ids) - max(len(tokens) - 1, 0)
            request.num_computed_tokens = (
                0
                if self.kv is None
                else item.num_computed_tokens + item.num_new_tokens - num_rejected
            )
            if not tokens:
                continue
            if item.spec_token_ids:
                self._record_verification(request, len(item.spec_token_ids), len(tokens) - 1)
            request.spec_token_ids = (proposed or {}).get(request.request_id, [])
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if self._append_until_stop(request, tokens):
                self._finish(request, now)
                finished.append(request)
            elif self.kv is not None and (item.spec_token_ids or item.num_tokens_to_draft):
                self.kv.trim(request, request.num_tokens)  # roll back rejected drafts' slots
        return finished

    @staticmethod
    def _append_until_stop(request: Request, tokens: list[int]) -> bool:
        """Append in order, checking the stop conditions after each token as plain decoding
        would; tokens after a stop are dropped. Returns whether the request finished."""
        for token in tokens:
            request.append_token(token)
            if request.check_stop():
                return True
        return False

    def _record_verification(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        assert self.speculation is not None
        metrics = request.metrics.spec_decode
        metrics.num_draft_tokens += num_drafted
        metrics.num_accepted_tokens += num_accepted
        metrics.num_verify_steps += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        self.stats.num_verify_steps += 1
        request.num_speculative_tokens = self.speculation.next_num_to_draft(
            request.num_speculative_tokens, num_drafted, num_accepted
        )

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> None:
        """End requests from outside (a stop string matched, or the caller aborted)."""
        now = time.monotonic()
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            request.finish_reason = reason
            self._finish(request, now)

    def _finish(self, request: Request, now: float) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            if self.kv is not None:
                self.kv.free(request)
        else:
            self._waiting = [entry for entry in self._waiting if entry[2] is not request]
            heapq.heapify(self._waiting)
        request.status = RequestStatus.FINISHED
        request.metrics.finish_time = now
        del self._requests[request.request_id]

    def _tokens_to_compute(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if self.kv is None or remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        if self.kv is None:
            return True
        while not self.kv.allocate_slots(request, num_new):
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_order))
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        assert self.kv is not None
        self.running.remove(request)
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        out.preempted.append(request)
        self._push_waiting(request)

    def _admit_waiting(self, budget: int, out: SchedulerOutput, speculate: bool) -> None:
        awaiting_parent: list[tuple[int, int, Request]] = []
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][2]
            if self._awaits_parent(request):
                awaiting_parent.append(heapq.heappop(self._waiting))
                continue
            cached = self._take_cached_prefix(request)
            num_new = self._tokens_to_compute(request, budget)
            plan = self._plan_speculation(request, num_new, budget, speculate)
            extra = self._extra_slots(plan)
            if extra and not self.kv.allocate_slots(request, num_new + extra, cached):
                plan, extra = _NO_SPECULATION, 0
            if num_new == 0 or (
                not extra
                and self.kv is not None
                and not self.kv.allocate_slots(request, num_new, cached)
            ):
                request.num_computed_tokens = 0
                break
            self._start(request)
            budget -= num_new + len(plan.drafts)
            out.scheduled.append(self._scheduled(request, num_new, plan))
        for entry in awaiting_parent:
            heapq.heappush(self._waiting, entry)

    def _plan_speculation(
        self, request: Request, num_new: int, budget: int, speculate: bool
    ) -> _SpeculationPlan:
        """Drafts to verify with a chunk that reaches the request's last token, cut to the
        budget, the context length and max_tokens, and how many to draft after it."""
        if not speculate or request.num_computed_tokens + num_new != request.num_tokens:
            return _NO_SPECULATION
        room = min(budget - num_new, request.max_model_len - request.num_tokens - 1)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - 1)
        drafts = tuple(request.spec_token_ids[: max(room, 0)])
        room_after = request.max_model_len - request.num_tokens - len(drafts)
        return _SpeculationPlan(drafts, max(min(request.num_speculative_tokens, room_after), 0))

    def _extra_slots(self, plan: _SpeculationPlan) -> int:
        """KV slots a plan needs beyond its chunk: its drafts and the drafter's lookahead.
        The caller takes them only if the pool has them without preempting anyone."""
        if self.speculation is None or self.kv is None:
            return 0
        return len(plan.drafts) + self.speculation.lookahead_slots(plan.num_to_draft)

    def _admit_static_batch(self) -> None:
        """Seal the next static batch: up to max_num_seqs requests join at once and nobody else
        joins until all of them finish; their prompts are then scheduled like running work."""
        while self._waiting and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][2]
            cached = self._take_cached_prefix(request)
            if self.kv is not None and not self.kv.allocate_slots(request, 0, cached):
                request.num_computed_tokens = 0
                break
            self._start(request)

    def _take_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The leading blocks a waiting request can reuse, counted as computed: the longer of
        its cached full blocks and, for a sibling, its parent's prompt but the last token.
        None for a request that wants prompt logprobs: each prompt position must be computed."""
        if self.kv is None or request.params.prompt_logprobs is not None:
            return []
        cached = self.kv.find_cached_prefix(request)
        request.num_computed_tokens = len(cached) * self.kv.block_size
        parent = self._fork_parent(request)
        num_shared = request.num_prompt_tokens - 1
        if (
            parent is None
            or parent.status != RequestStatus.RUNNING
            or not parent.num_computed_tokens >= num_shared > request.num_computed_tokens
        ):
            return cached
        request.num_computed_tokens = num_shared
        return self.kv.shared_prompt(parent, num_shared)

    def _fork_parent(self, request: Request) -> Request | None:
        """The unfinished parent a sibling may fork its prompt from, if forking applies: not
        under static batching (the whole batch is admitted before anything is computed) and
        not with the contiguous baseline (whose requests each reserve their own span)."""
        if (
            request.parent_request_id is None
            or self.static_batching
            or self.kv is None
            or self.kv.reserve_tokens is not None
        ):
            return None
        return self._requests.get(request.parent_request_id)

    def _awaits_parent(self, request: Request) -> bool:
        """Whether a sibling should wait for its parent to compute the prompt (all of it but
        the last token) rather than compute the prompt itself."""
        parent = self._fork_parent(request)
        if parent is None:
            return False
        return parent.num_computed_tokens < request.num_prompt_tokens - 1

    def _start(self, request: Request) -> None:
        heapq.heappop(self._waiting)
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = request.num_computed_tokens
            self.stats.num_prompt_tokens_cached += request.num_computed_tokens
            self.stats.num_prompt_tokens_queried += request.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _scheduled(
        self, request: Request, num_new: int, plan: _SpeculationPlan
    ) -> ScheduledRequest:
        block_ids = self.kv.block_ids(request.request_id) if self.kv is not None else []
        return ScheduledRequest(
            request,
            num_new + len(plan.drafts),
            request.num_computed_tokens,
            block_ids,
            plan.drafts,
            plan.num_to_draft,
        )

    def _push_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (request.priority, request.arrival_order, request))


@dataclass(frozen=True)
class _SpeculationPlan:
    drafts: tuple[int, ...]
    num_to_draft: int


_NO_SPECULATION = _SpeculationPlan((), 0)
