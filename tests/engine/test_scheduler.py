"""Scheduler behaviour without a model: budgets, chunking, priorities, preemption, n > 1
siblings forking their parent's prompt, no leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.admission import StaticAdmission
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv.paged import PagedKVManager
from tokenmill.request import FinishReason, Request
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler_output import SchedulerOutput


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, **kwargs) -> Scheduler:
    kv = PagedKVManager(num_blocks, block_size)
    return Scheduler(kv, max_num_seqs, budget, **kwargs)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, priority=0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(range(1, prompt_len + 1)), params, priority=priority)


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """Stand-in for the runner: every sampling request gets token 7."""
    out = scheduler.schedule()
    check_block_copies(scheduler, out)
    sampled = {s.request.request_id: [7] for s in out.scheduled if s.samples}
    scheduler.update(out, sampled)
    return out


def check_block_copies(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Each copy goes into its own block, and every holder of that block computes this step, so
    nobody reads it before the copy runs: the request that writes it, and any request admitted
    later in the step that hit it in the prefix cache (it is published, full, at allocation)."""
    destinations = [dst for _, dst in out.block_copies]
    assert len(set(destinations)) == len(destinations)
    for dst in destinations:
        holders = [s for s in out.scheduled if dst in s.block_ids]
        assert holders and scheduler.kv.pool.blocks[dst].ref_count == len(holders)


def test_long_prompt_is_split_into_chunks_under_the_budget():
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 40))
    chunks = [fake_step(scheduler).num_tokens for _ in range(3)]
    assert chunks == [16, 16, 8]


def test_without_chunked_prefill_a_prompt_over_budget_waits():
    scheduler = make_scheduler(budget=16, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 40))
    assert fake_step(scheduler).num_tokens == 0


def test_running_decodes_come_before_new_prefills():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    fake_step(scheduler)
    scheduler.add_request(make_request("b", 20))
    out = fake_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_lower_priority_value_is_admitted_first_then_fcfs():
    scheduler = make_scheduler(max_num_seqs=1)
    for request_id, priority in [("late", 1), ("first", 0), ("second", 0)]:
        scheduler.add_request(make_request(request_id, 4, max_tokens=1, priority=priority))
    order = [fake_step(scheduler).scheduled[0].request.request_id for _ in range(3)]
    assert order == ["first", "second", "late"]


def test_preemption_frees_the_latest_arrival_and_it_resumes():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_request("a", 6, max_tokens=6), make_request("b", 6, max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted = []
    while scheduler.has_unfinished_requests():
        preempted += [r.request_id for r in fake_step(scheduler).preempted]
    assert preempted and set(preempted) == {"b"}
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert scheduler.kv.pool.num_free_blocks == 4


def test_static_batching_admits_nothing_while_a_batch_runs():
    scheduler = make_scheduler(admission=StaticAdmission())
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    fake_step(scheduler)
    scheduler.add_request(make_request("b", 4))
    ids = {s.request.request_id for s in fake_step(scheduler).scheduled}
    assert ids == {"a"}


def test_static_batch_takes_max_num_seqs_requests_even_beyond_one_steps_budget():
    scheduler = make_scheduler(max_num_seqs=4, budget=16, admission=StaticAdmission())
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 10, max_tokens=2))
    fake_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["r0", "r1", "r2", "r3"]
    while any(not r.output_token_ids for r in scheduler.running):
        fake_step(scheduler)
    assert {r.request_id for r in scheduler.running} <= {"r0", "r1", "r2", "r3"}


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("a", 10))
    fake_step(scheduler)
    assert scheduler.kv.pool.num_free_blocks < 8
    scheduler.finish_requests(["a"], FinishReason.ABORT)
    assert scheduler.kv.pool.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests()


def make_siblings(request_id: str, prompt_len: int, n: int, max_tokens: int = 4) -> list[Request]:
    """The n children the engine makes of one request: the later ones fork the first."""
    children = [make_request(f"{request_id}#{i}", prompt_len, max_tokens) for i in range(n)]
    for sibling in children[1:]:
        sibling.parent_request_id = children[0].request_id
    return children


def scheduled_tokens(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_siblings_fork_the_parents_prompt_and_copy_its_partial_block():
    scheduler = make_scheduler(block_size=4)
    for child in make_siblings("r", 10, n=3):
        scheduler.add_request(child)
    assert scheduled_tokens(fake_step(scheduler)) == [("r#0", 0, 10)]
    out = fake_step(scheduler)
    assert scheduled_tokens(out) == [("r#0", 10, 1), ("r#1", 9, 1), ("r#2", 9, 1)]
    tables = [scheduler.kv.block_ids(f"r#{i}") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert out.block_copies == [(tables[0][2], tables[1][2]), (tables[0][2], tables[2][2])]
    assert fake_step(scheduler).block_copies == []


def test_siblings_waiting_for_their_parent_do_not_hold_up_the_queue():
    scheduler = make_scheduler(block_size=4)
    for child in make_siblings("r", 10, n=3):
        scheduler.add_request(child)
    scheduler.add_request(make_request("later", 5))
    assert [s.request.request_id for s in fake_step(scheduler).scheduled] == ["r#0", "later"]


def test_siblings_of_a_finished_parent_reuse_its_cached_blocks_instead():
    scheduler = make_scheduler(block_size=4)
    for child in make_siblings("r", 10, n=2, max_tokens=1):
        scheduler.add_request(child)
    fake_step(scheduler)
    assert scheduled_tokens(fake_step(scheduler)) == [("r#1", 8, 2)]
    assert scheduler.kv.pool.num_free_blocks == 64


def check_pool_invariants(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    held: dict[int, int] = {}
    for request in scheduler.running:
        for block_id in scheduler.kv.block_ids(request.request_id):
            held[block_id] = held.get(block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == held.get(block.block_id, 0)
        in_free_queue = block.block_id in pool._free
        assert in_free_queue == (block.ref_count == 0), "a block is both free and in a table"


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 12), st.integers(0, 2)),
        st.tuples(st.just("fork"), st.integers(1, 20), st.integers(1, 12), st.integers(2, 4)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 20), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(actions=actions, num_blocks=st.integers(8, 24), shared=st.booleans())
def test_random_add_step_abort_never_leaks_or_double_books_blocks(actions, num_blocks, shared):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4, budget=16)
    added: list[str] = []
    for kind, a, b, c in actions:
        if kind in ("add", "fork"):
            prompt = [*range(1, 9), *range(a)] if shared else list(range(1, a + 1))
            n, priority = (c, 0) if kind == "fork" else (1, c)
            children = [
                Request(
                    f"r{len(added)}#{i}",
                    prompt,
                    SamplingParams(max_tokens=b, ignore_eos=True),
                    priority=priority,
                    max_model_len=num_blocks * 4,  # as the engine caps it: one always fits
                )
                for i in range(n)
            ]
            for sibling in children[1:]:
                sibling.parent_request_id = children[0].request_id
            for child in children:
                scheduler.add_request(child)
                added.append(child.request_id)
        elif kind == "step":
            for _ in range(a):
                fake_step(scheduler)
        elif added:
            scheduler.finish_requests([added[a % len(added)]], FinishReason.ABORT)
        check_pool_invariants(scheduler)
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        fake_step(scheduler)
        check_pool_invariants(scheduler)
    assert not scheduler.has_unfinished_requests(), "requests stopped making progress"
    assert scheduler.kv.pool.num_free_blocks == num_blocks
