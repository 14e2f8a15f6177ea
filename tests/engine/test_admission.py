"""Admission policies with a fake clock: the dynamic batcher closes a batch when it is full or
its oldest request has waited max_wait, and admits nobody while a batch runs."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineArgs
from tokenmill.engine.admission import (
    ContinuousAdmission,
    DynamicAdmission,
    StaticAdmission,
    make_admission_policy,
)
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv.paged import PagedKVManager
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_request(request_id: str, arrival: float, max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, [1, 2, 3], params)
    request.metrics.arrival_time = arrival
    return request


def step(scheduler: Scheduler) -> set[str]:
    """One scheduling step in which every sampling request gets token 7; the ids it ran."""
    out = scheduler.schedule()
    scheduler.update(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
    return {s.request.request_id for s in out.scheduled}


def dynamic_scheduler(clock: FakeClock, max_batch_size: int = 4, max_wait_s: float = 0.05):
    policy = DynamicAdmission(max_batch_size, max_wait_s, clock)
    return Scheduler(PagedKVManager(64, 4), max_batch_size, 64, admission=policy)


def test_a_batch_waits_for_the_oldest_request_to_wait_max_wait():
    clock = FakeClock()
    scheduler = dynamic_scheduler(clock)
    scheduler.add_request(make_request("a", clock.now))
    clock.now += 0.03
    scheduler.add_request(make_request("b", clock.now))
    assert step(scheduler) == set()
    clock.now += 0.019
    assert step(scheduler) == set()
    clock.now += 0.001  # "a" has now waited 50 ms
    assert step(scheduler) == {"a", "b"}


def test_a_full_batch_closes_without_waiting():
    clock = FakeClock()
    scheduler = dynamic_scheduler(clock, max_batch_size=3)
    for name in "abcd":
        scheduler.add_request(make_request(name, clock.now))
    assert step(scheduler) == {"a", "b", "c"}


def test_nobody_joins_a_running_batch():
    clock = FakeClock()
    scheduler = dynamic_scheduler(clock, max_batch_size=2)
    scheduler.add_request(make_request("a", clock.now, max_tokens=3))
    scheduler.add_request(make_request("b", clock.now, max_tokens=3))
    assert step(scheduler) == {"a", "b"}
    scheduler.add_request(make_request("c", clock.now))
    scheduler.add_request(make_request("d", clock.now))
    clock.now += 1.0  # long past max_wait, and full: still not while a batch runs
    assert step(scheduler) == {"a", "b"}
    assert step(scheduler) == {"a", "b"}  # the third and last token
    assert not scheduler.running
    assert step(scheduler) == {"c", "d"}


def test_policies_answer_the_schedulers_two_questions():
    assert ContinuousAdmission().joins_running_batch
    assert not ContinuousAdmission().seals_batch(0, 5, 0.0)
    assert StaticAdmission().seals_batch(0, 1, 0.0) and not StaticAdmission().seals_batch(1, 1, 0.0)
    clock = FakeClock()
    dynamic = DynamicAdmission(4, 0.05, clock)
    assert not dynamic.joins_running_batch
    assert not dynamic.seals_batch(0, 0, None)
    assert dynamic.seals_batch(0, 4, clock.now) and not dynamic.seals_batch(1, 4, 0.0)


def test_the_dynamic_policy_is_built_from_the_engine_switches():
    policy = make_admission_policy("dynamic", max_num_seqs=8, max_wait_ms=20)
    assert isinstance(policy, DynamicAdmission)
    assert (policy.max_batch_size, policy.max_wait_s) == (8, 0.02)


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "50", True])
def test_a_bad_max_wait_is_refused(value):
    with pytest.raises(ValueError, match="max_wait_ms"):
        EngineArgs(scheduler="dynamic", max_wait_ms=value)
