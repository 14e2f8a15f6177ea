"""Iteration-level scheduling: each step, hand out a token budget across requests.

Running requests go first (a decode costs one token, an unfinished prompt a chunk), then
waiting requests are admitted by (priority, arrival) while budget, sequence slots and KV blocks
last. When a running request cannot get a block, the least important running request (highest
priority value, then latest arrival) is preempted: its blocks are freed and it waits to be
recomputed, which the prefix cache usually makes cheap. The scheduler never sees a tensor.
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


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new one is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens_cached: int = 0
    num_prompt_tokens_queried: int = 0


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        static_batching: bool = False,
    ) -> None:
        """`kv_manager=None` means no KV cache: every step recomputes each whole sequence."""
        self.kv = kv_manager
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

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_order = next(self._arrivals)
        self._requests[request.request_id] = request
        self._push_waiting(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.static_batching and not self.running:
            self._admit_static_batch()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = self._tokens_to_compute(request, budget)
            if num_new == 0:
                continue
            if not self._allocate_or_preempt(request, num_new, out):
                continue
            budget -= num_new
            out.scheduled.append(self._scheduled(request, num_new))
        if not out.preempted and not self.static_batching:
            self._admit_waiting(budget, out)
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record the step's progress and new tokens; returns the requests that finished."""
        finished = []
        now = time.monotonic()
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens = (
                0 if self.kv is None else item.num_computed_tokens + item.num_new_tokens
            )
            token = sampled.get(request.request_id)
            if token is None:
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.append_token(token)
            if request.check_stop():
                self._finish(request, now)
                finished.append(request)
        return finished

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

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][2]
            cached = self._take_cached_prefix(request)
            num_new = self._tokens_to_compute(request, budget)
            if num_new == 0 or (
                self.kv is not None and not self.kv.allocate_slots(request, num_new, cached)
            ):
                request.num_computed_tokens = 0
                break
            self._start(request)
            budget -= num_new
            out.scheduled.append(self._scheduled(request, num_new))

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
        """The cached leading blocks a waiting request can reuse; counts them as computed."""
        if self.kv is None:
            return []
        cached = self.kv.find_cached_prefix(request)
        request.num_computed_tokens = len(cached) * self.kv.block_size
        return cached

    def _start(self, request: Request) -> None:
        heapq.heappop(self._waiting)
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = request.num_computed_tokens
            self.stats.num_prompt_tokens_cached += request.num_computed_tokens
            self.stats.num_prompt_tokens_queried += request.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        block_ids = self.kv.block_ids(request.request_id) if self.kv is not None else []
        return ScheduledRequest(request, num_new, request.num_computed_tokens, block_ids)

    def _push_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (request.priority, request.arrival_order, request))
