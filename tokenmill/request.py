"""A request as the scheduler sees it: token ids, progress counters, status. No tensors.

The scheduler alone changes a request's status and decides where it ends."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller


@dataclass
class SpecDecodeMetrics:
    """How speculative decoding went for one request (all zero without speculation).

    The times are the wall time of the draft and verify passes of the steps the request took
    part in, so in a batch they are shared with the other requests of those steps."""

    num_draft_tokens: int = 0  # drafts the target verified
    num_accepted_tokens: int = 0  # drafts it accepted
    num_verify_steps: int = 0  # steps that verified at least one draft
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def accepted_tokens_per_step(self) -> float:
        """Drafts accepted per verify step (a tree's count its accepted path only)."""
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: the accepted drafts plus the target's own token."""
        if not self.num_verify_steps:
            return 0.0
        return 1 + self.num_accepted_tokens / self.num_verify_steps


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) from which TTFT, TPOT and latency follow."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    spec_decode: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    There is no prefill or decode phase: `num_computed_tokens` trails `num_tokens`, and each
    step the scheduler hands out some of the difference. Preemption resets the counter to 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    max_model_len: int = 1 << 31
    arrival_order: int = 0  # FCFS tie-break within a priority, assigned by the scheduler
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_disk_cached_tokens: int = 0  # the part of them loaded from the disk tier
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # The prefix-cache hash of each full block of `all_token_ids`, in order: a digest of the
    # previous block's hash and this block's token ids (kv.block_pool.BlockHash).
    block_hashes: list[bytes] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed after the last step
    spec_parents: list[int] = field(default_factory=list)  # their tree; empty: a chain
    num_speculative_tokens: int = 0  # how many to draft next; adapts to the acceptance
    parent_request_id: str | None = None  # an n > 1 sibling whose computed prompt KV this forks
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the tokens after the first `num_output_tokens` (several tokens can arrive in one
        step, and a stop string may end generation in the middle of them)."""
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
        del self.output_token_ids[num_output_tokens:]
