"""Admission policies: when waiting requests may join the running batch. No tensors.

The scheduler asks a policy two questions each step: may waiting requests join a batch that is
already running (continuous batching), and, if not, is it time to seal a new batch from the
queue (static batching: whenever nothing runs; the dynamic batcher: once the batch is full or
its oldest request has waited long enough). A sealed batch runs to completion before the next
one is admitted.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable


class AdmissionPolicy(ABC):
    joins_running_batch: bool
    """True: waiting requests join any step with token budget, sequence slots and KV left."""

    @abstractmethod
    def seals_batch(self, num_running: int, num_waiting: int, oldest_arrival: float | None) -> bool:
        """Whether to admit a new batch now, up to `max_num_seqs` from the queue at once.
        `oldest_arrival`: the earliest `time.monotonic()` arrival among the waiting requests
        (None when none waits)."""


class ContinuousAdmission(AdmissionPolicy):
    """Iteration-level batching: a finished request's place is taken at the next step."""

    joins_running_batch = True

    def seals_batch(self, num_running: int, num_waiting: int, oldest_arrival: float | None) -> bool:
        return False


class StaticAdmission(AdmissionPolicy):
    """The baseline: a batch is sealed when nothing runs, and nobody joins until all of it
    finishes, so short requests wait for the longest one of their batch."""

    joins_running_batch = False

    def seals_batch(self, num_running: int, num_waiting: int, oldest_arrival: float | None) -> bool:
        return num_running == 0 and num_waiting > 0


class DynamicAdmission(AdmissionPolicy):
    """The dynamic batcher of request-level serving: a batch closes when `max_batch_size`
    requests wait or the oldest has waited `max_wait_s`, whichever comes first, and then runs
    to completion while new arrivals queue for the next one. Waiting trades a little latency
    for fuller batches than static batching's first-come batches under sparse arrivals."""

    joins_running_batch = False

    def __init__(
        self, max_batch_size: int, max_wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.clock = clock

    def seals_batch(self, num_running: int, num_waiting: int, oldest_arrival: float | None) -> bool:
        if num_running or oldest_arrival is None:
            return False
        full = num_waiting >= self.max_batch_size
        return full or self.clock() - oldest_arrival >= self.max_wait_s


def make_admission_policy(name: str, max_num_seqs: int, max_wait_ms: float) -> AdmissionPolicy:
    """The policy `scheduler=name` asks for (config.SCHEDULERS)."""
    if name == "continuous":
        return ContinuousAdmission()
    if name == "static":
        return StaticAdmission()
    if name == "dynamic":
        return DynamicAdmission(max_num_seqs, max_wait_ms / 1000)
    raise ValueError(f"scheduler must be one of continuous, static, dynamic, got {name!r}")
