"""Iteration-level scheduling: each step, hand out a token budget across requests.

Running requests go first (a decode costs one token, an unfinished prompt a chunk), then
waiting requests are admitted by (priority, arrival) while budget, sequence slots and KV blocks
last, when the admission policy lets them join (engine/admission.py). When a running request
cannot get a block, the least important running request (highest priority value, then latest
arrival) is preempted: its blocks are freed and it waits to be recomputed, which the prefix
cache usually makes cheap. KV comes through one KVCacheManager interface, whatever the cache
mode. The scheduler never sees a tensor.

The scheduler alone ends a request: on a stop token, EOS, max_tokens or the context length as
it appends tokens, on a stop string the output processor reports (`stop_at_string`), when a
request's grammar has ended (`stop_at_grammar_end`, reported by the structured-output manager),
or on an abort.

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
from dataclasses import dataclass

from tokenmill.draft_tree import first_path, is_chain
from tokenmill.engine.admission import AdmissionPolicy, ContinuousAdmission
from tokenmill.kv.block_pool import DiskBlock, KVBlock
from tokenmill.kv.kv_manager import KVCacheManager
from tokenmill.request import FinishReason, Request, RequestStatus
from tokenmill.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenmill.spec.policy import SpeculationPolicy


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens_cached: int = 0
    num_prompt_tokens_queried: int = 0
    num_prompt_tokens_from_disk: int = 0  # the part of the cached ones the disk tier served
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    spec_draft_time_s: float = 0.0  # time of the steps' proposer calls that drafted
    spec_verify_time_s: float = 0.0  # time of the steps that verified drafts


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        admission: AdmissionPolicy | None = None,
        speculation: SpeculationPolicy | None = None,
    ) -> None:
        """`admission`: continuous batching unless another policy is given."""
        self.kv = kv_manager
        self.admission = admission or ContinuousAdmission()
        self.speculation = speculation
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
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
        self.kv.expire()
        if self.admission.seals_batch(
            len(self.running), len(self._waiting), self._oldest_waiting_arrival()
        ):
            self._seal_batch()
        budget = self.max_num_batched_tokens
        # The batch this step will run: the running requests and those about to be admitted.
        batch_size = min(len(self._requests), self.max_num_seqs)
        speculate = self.speculation is not None and self.speculation.enabled_for(batch_size)
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
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
        if self.admission.joins_running_batch and not out.preempted:
            self._admit_waiting(budget, out, speculate)
        out.block_copies = self.kv.take_block_copies()
        out.kv_saves, out.kv_loads = self.kv.take_tier_transfers()
        return out

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        proposed: dict[str, list[int]] | None = None,
        verify_time_s: float = 0.0,
        draft_time_s: float = 0.0,
        proposed_parents: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Record the step's progress and new tokens (several when drafts were accepted), the
        drafts proposed for the next step (`proposed_parents`: the trees among them) and the
        time speculation took; returns the requests that finished."""
        finished = []
        now = time.monotonic()
        self._charge_speculation_time(out, verify_time_s, draft_time_s)
        for item in out.scheduled:
            request = item.request
            tokens = sampled.get(request.request_id, [])
            num_rejected = len(item.spec_token_ids) - max(len(tokens) - 1, 0)
            request.num_computed_tokens = (
                item.num_computed_tokens + item.num_new_tokens - num_rejected
                if self.kv.holds_kv
                else 0
            )
            if not tokens:
                continue
            if item.spec_token_ids:
                self._record_verification(request, len(item.spec_token_ids), len(tokens) - 1)
            request.spec_token_ids = (proposed or {}).get(request.request_id, [])
            request.spec_parents = (proposed_parents or {}).get(request.request_id, [])
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if self._append_until_stop(request, tokens):
                self._finish(request, now)
                finished.append(request)
            elif item.spec_token_ids or item.num_tokens_to_draft:
                self.kv.trim(request, request.num_tokens)  # roll back rejected drafts' slots
        return finished

    def stop_at_string(self, request: Request, num_output_tokens: int, stop: str) -> None:
        """The output processor found stop string `stop` completed by output token
        `num_output_tokens`: drop the tokens after it and end the request there, also when a
        later token of the same step had already ended it another way."""
        request.truncate_output(num_output_tokens)
        request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        if not request.is_finished:
            self._finish(request, time.monotonic())

    def stop_at_grammar_end(self, request: Request) -> None:
        """The request's output grammar has ended (it is complete, or allows nothing further):
        end the request after its last token, as a stop token would."""
        if not request.is_finished:
            request.finish_reason = FinishReason.STOP
            self._finish(request, time.monotonic())

    @staticmethod
    def _append_until_stop(request: Request, tokens: list[int]) -> bool:
        """Append in order, checking the stop conditions after each token as plain decoding
        would; tokens after a stop are dropped. Returns whether the request finished."""
        for token in tokens:
            request.append_token(token)
            if _reached_stop(request):
                return True
        return False

    def _charge_speculation_time(
        self, out: SchedulerOutput, verify_time_s: float, draft_time_s: float
    ) -> None:
        """Each request that verified drafts pays the step's verify time, each that asked for
        drafts the proposer's time; the totals count each step once."""
        verified = drafted = False
        for item in out.scheduled:
            metrics = item.request.metrics.spec_decode
            if item.spec_token_ids:
                metrics.verify_time_s += verify_time_s
                verified = True
            if item.num_tokens_to_draft:
                metrics.draft_time_s += draft_time_s
                drafted = True
        self.stats.spec_verify_time_s += verify_time_s if verified else 0.0
        self.stats.spec_draft_time_s += draft_time_s if drafted else 0.0

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
            self.kv.free(request)
        else:
            self._waiting = [entry for entry in self._waiting if entry[2] is not request]
            heapq.heapify(self._waiting)
        request.status = RequestStatus.FINISHED
        request.metrics.finish_time = now
        del self._requests[request.request_id]

    def _tokens_to_compute(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining <= budget or not self.kv.holds_kv:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_order))
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
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
            if num_new == 0 or (not extra and not self.kv.allocate_slots(request, num_new, cached)):
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
        drafts, parents = _draft_tree_for(request)
        # A prefix of a tree is a tree, no deeper than it is long.
        drafts, parents = drafts[: max(room, 0)], parents[: max(room, 0)]
        room_after = request.max_model_len - request.num_tokens - len(drafts)
        return _SpeculationPlan(
            drafts, max(min(request.num_speculative_tokens, room_after), 0), parents
        )

    def _extra_slots(self, plan: _SpeculationPlan) -> int:
        """KV slots a plan needs beyond its chunk: its drafts and the drafter's lookahead.
        The caller takes them only if the pool has them without preempting anyone."""
        if self.speculation is None:
            return 0
        return len(plan.drafts) + self.speculation.lookahead_slots(plan.num_to_draft)

    def _oldest_waiting_arrival(self) -> float | None:
        """Only asked for while nothing runs, when a batch policy may seal the next batch."""
        if self.running or not self._waiting:
            return None
        return min(entry[2].metrics.arrival_time for entry in self._waiting)

    def _seal_batch(self) -> None:
        """Admit the next batch: up to max_num_seqs requests join at once (the policy lets
        nobody else join until all of them finish); their prompts are then scheduled like
        running work."""
        while self._waiting and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][2]
            cached = self._take_cached_prefix(request)
            if not self.kv.allocate_slots(request, 0, cached):
                request.num_computed_tokens = 0
                break
            self._start(request)

    def _take_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The leading blocks a waiting request can reuse, counted as computed: the longer of
        its cached full blocks and, for a sibling, its parent's prompt but the last token.
        None for a request that wants prompt logprobs: each prompt position must be computed."""
        if request.params.prompt_logprobs is not None:
            return []
        cached = self.kv.find_cached_prefix(request)
        request.num_computed_tokens = len(cached) * self.kv.block_size
        if request.metrics.first_scheduled_time is None:
            from_disk = sum(isinstance(block, DiskBlock) for block in cached)
            request.num_disk_cached_tokens = from_disk * self.kv.block_size
        parent = self._fork_parent(request)
        num_shared = request.num_prompt_tokens - 1
        if (
            parent is None
            or parent.status != RequestStatus.RUNNING
            or not parent.num_computed_tokens >= num_shared > request.num_computed_tokens
        ):
            return cached
        shared = self.kv.shared_prompt(parent, num_shared)
        if not shared:  # a window of the parent's has moved past blocks the sibling reads
            return cached
        request.num_computed_tokens = num_shared
        request.num_disk_cached_tokens = 0
        return shared

    def _fork_parent(self, request: Request) -> Request | None:
        """The unfinished parent a sibling may fork its prompt from, where the KV manager shares
        blocks. (A sealed batch admits parent and siblings together, before the parent has
        computed anything to fork, so they compute the prompt each.)"""
        if request.parent_request_id is None or not self.kv.shares_blocks:
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
            self.stats.num_prompt_tokens_from_disk += request.num_disk_cached_tokens
            self.stats.num_prompt_tokens_queried += request.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _scheduled(
        self, request: Request, num_new: int, plan: _SpeculationPlan
    ) -> ScheduledRequest:
        tables = self.kv.group_block_ids(request.request_id)
        return ScheduledRequest(
            request,
            num_new + len(plan.drafts),
            request.num_computed_tokens,
            tables[0],
            plan.drafts,
            plan.num_to_draft,
            tuple(tables) if len(tables) > 1 else (),
            plan.parents if plan.drafts else (),
        )

    def _push_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (request.priority, request.arrival_order, request))


def _draft_tree_for(request: Request) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The request's drafts and their tree's parents (() for a chain). A request with a grammar
    verifies a tree's first path only: its token masks follow one sequence of drafts."""
    drafts, parents = tuple(request.spec_token_ids), tuple(request.spec_parents)
    if not parents or is_chain(parents):
        return drafts, ()
    if request.params.structured_outputs is not None:
        return tuple(drafts[i] for i in first_path(parents)), ()
    return drafts, parents


@dataclass(frozen=True)
class _SpeculationPlan:
    drafts: tuple[int, ...]
    num_to_draft: int
    parents: tuple[int, ...] = ()  # the drafts' tree; (): a chain


_NO_SPECULATION = _SpeculationPlan((), 0)


def _reached_stop(request: Request) -> bool:
    """After a token was appended: should generation end here? Sets the finish reason."""
    last = request.output_token_ids[-1]
    num_output = len(request.output_token_ids)
    params = request.params
    if num_output >= params.min_tokens:
        if last in params.stop_token_ids:
            request.finish_reason, request.stop_reason = FinishReason.STOP, last
            return True
        if not params.ignore_eos and last in request.eos_token_ids:
            request.finish_reason = FinishReason.STOP
            return True
    if params.max_tokens is not None and num_output >= params.max_tokens:
        request.finish_reason = FinishReason.LENGTH
        return True
    if request.num_tokens >= request.max_model_len:
        request.finish_reason = FinishReason.LENGTH
        return True
    return False
