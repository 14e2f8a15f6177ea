"""Admission policies: when waiting requests may join the running batch. No tensors.

The scheduler asks a policy two questions each step: may waiting requests join a batch that is
already running (continuous batching), and, if not, is it time to seal a new batch from the
queue (static batching: whenever nothing runs). A sealed batch runs to completion before the
next one is admitted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class AdmissionPolicy(ABC):
    joins_running_batch: bool
    """True: waiting requests join any step with token budget, sequence slots and KV left."""

    @abstractmethod
    def seals_batch(self, num_running: int, num_waiting: int) -> bool:
        """Whether to admit a new batch now, up to `max_num_seqs` from the queue at once."""


class ContinuousAdmission(AdmissionPolicy):
    """Iteration-level batching: a finished request's place is taken at the next step."""

    joins_running_batch = True

    def seals_batch(self, num_running: int, num_waiting: int) -> bool:
        return False


class StaticAdmission(AdmissionPolicy):
    """The baseline: a batch is sealed when nothing runs, and nobody joins until all of it
    finishes, so short requests wait for the longest one of their batch."""

    joins_running_batch = False

    def seals_batch(self, num_running: int, num_waiting: int) -> bool:
        return num_running == 0 and num_waiting > 0


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    "continuous": ContinuousAdmission,
    "static": StaticAdmission,
}
