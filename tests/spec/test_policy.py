"""The scheduler's side of speculation, without a model: how many drafts go into a step, how
rejected ones are rolled back, and when speculation steps aside."""

from __future__ import annotations

from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv.paged import PagedKVManager
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.spec.policy import SpeculationPolicy

BLOCK = 4


def policy(k=4, disable=None, adaptive=False, writes_kv=False) -> SpeculationPolicy:
    return SpeculationPolicy(k, disable, adaptive, writes_kv)


def make_scheduler(spec: SpeculationPolicy, num_blocks=32, budget=64) -> Scheduler:
    return Scheduler(PagedKVManager(num_blocks, BLOCK), 8, budget, speculation=spec)


def decoding_request(scheduler: Scheduler, request_id="a", prompt_len=6, max_tokens=50) -> Request:
    """A request whose prompt is computed and whose first token is sampled."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, list(range(1, prompt_len + 1)), params)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update(out, {request_id: [100]}, {request_id: [101, 102, 103, 104]})
    return request


def test_adaptive_k_grows_after_full_acceptance_and_shrinks_after_a_miss():
    spec = policy(k=5, adaptive=True)
    assert spec.next_num_to_draft(3, num_drafted=3, num_accepted=3) == 4
    assert spec.next_num_to_draft(5, num_drafted=5, num_accepted=5) == 5
    assert spec.next_num_to_draft(5, num_drafted=5, num_accepted=1) == 2
    assert spec.next_num_to_draft(4, num_drafted=0, num_accepted=0) == 4
    assert policy(k=5).next_num_to_draft(3, num_drafted=3, num_accepted=0) == 3


def test_speculation_is_off_above_the_disable_batch_size():
    assert policy(disable=2).enabled_for(2)
    assert not policy(disable=2).enabled_for(3)
    assert policy().enabled_for(1000)


def test_drafts_ride_on_the_chunk_that_reaches_the_last_token():
    scheduler = make_scheduler(policy())
    decoding_request(scheduler)
    (item,) = scheduler.schedule().scheduled
    assert item.spec_token_ids == (101, 102, 103, 104)
    assert item.num_new_tokens == 5 and item.samples


def test_rejected_drafts_are_rolled_back_and_their_blocks_freed():
    scheduler = make_scheduler(policy())
    request = decoding_request(scheduler)  # 7 tokens, 6 computed
    out = scheduler.schedule()  # positions 6..10: the last token and 4 drafts, in 3 blocks
    assert scheduler.kv.num_blocks_held("a") == 3
    scheduler.update(out, {"a": [101, 55]})  # one draft accepted, then the target's own 55
    assert request.output_token_ids == [100, 101, 55]
    assert request.num_computed_tokens == 8  # through the accepted draft; 55 is not computed
    out = scheduler.schedule()  # positions 8..9: no drafts were proposed this time
    scheduler.update(out, {"a": [56]})
    assert request.num_computed_tokens == 9
    assert scheduler.kv.num_blocks_held("a") == 3  # 10 tokens

    scheduler = make_scheduler(policy())
    request = decoding_request(scheduler)
    scheduler.update(scheduler.schedule(), {"a": [55]})  # every draft rejected
    assert request.num_computed_tokens == 7
    assert scheduler.kv.num_blocks_held("a") == 2  # 8 tokens: the drafts' third block is freed
    stats = scheduler.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verify_steps) == (4, 0, 1)


def test_draft_count_respects_max_tokens_and_the_budget():
    scheduler = make_scheduler(policy(), budget=3)
    decoding_request(scheduler, prompt_len=2)
    (item,) = scheduler.schedule().scheduled
    assert item.spec_token_ids == (101, 102)  # the last token and two drafts fill the budget
    scheduler = make_scheduler(policy())
    decoding_request(scheduler, max_tokens=3)
    (item,) = scheduler.schedule().scheduled
    assert item.spec_token_ids == (101,)  # one output so far: at most two more tokens


def test_a_drafter_that_writes_kv_gets_lookahead_slots():
    scheduler = make_scheduler(policy(writes_kv=True))
    decoding_request(scheduler)
    (item,) = scheduler.schedule().scheduled
    assert item.num_tokens_to_draft == 4
    # 7 tokens + 4 drafts + 4 lookahead = 15 slots
    assert scheduler.kv.num_blocks_held("a") == 4


def test_speculation_never_preempts_another_request():
    scheduler = make_scheduler(policy(), num_blocks=4)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    requests = [Request(name, [first, 2, 3, 4, 5, 6], params) for first, name in enumerate("ab")]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()  # two blocks each: the pool is full
    drafts = [101, 102, 103, 104]
    scheduler.update(out, {"a": [100], "b": [100]}, {"a": drafts, "b": drafts})
    out = scheduler.schedule()
    assert [item.spec_token_ids for item in out.scheduled] == [(), ()]
    assert not out.preempted


def test_a_draft_tree_rides_with_its_parents_cut_to_the_budget():
    scheduler = make_scheduler(policy(k=8), budget=6)
    request = decoding_request(scheduler)
    request.spec_token_ids, request.spec_parents = [11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, 2, 4]
    (item,) = scheduler.schedule().scheduled
    assert item.spec_token_ids == (11, 12, 13, 14, 15)  # the budget leaves 5 drafts: a prefix
    assert item.spec_parents == (-1, -1, 0, 0, 2)


def test_an_accepted_tree_path_keeps_kv_up_to_its_last_draft():
    scheduler = make_scheduler(policy(k=8))
    request = decoding_request(scheduler)  # 7 tokens, 6 computed
    request.spec_token_ids, request.spec_parents = [11, 12, 13, 14], [-1, -1, 0, 1]
    out = scheduler.schedule()
    scheduler.update(out, {"a": [12, 14, 99]})  # the path through drafts 1 and 3, then 99
    assert request.output_token_ids[-3:] == [12, 14, 99]
    assert request.num_computed_tokens == 9  # the root and the two accepted drafts


def test_a_request_with_a_grammar_verifies_the_trees_first_path():
    scheduler = make_scheduler(policy(k=8))
    request = decoding_request(scheduler)
    request.params = SamplingParams(
        max_tokens=50, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a+")
    )
    request.spec_token_ids, request.spec_parents = [11, 12, 13, 14], [-1, -1, 0, 2]
    (item,) = scheduler.schedule().scheduled
    assert item.spec_token_ids == (11, 13, 14)
    assert item.spec_parents == ()
