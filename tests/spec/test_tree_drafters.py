"""Both tree drafters, the shipped Medusa heads and the shipped EAGLE head drafting EAGLE-2's
dynamic tree, leave greedy and seeded output unchanged, alone, in a batch of eight and across
preemption, without leaking blocks (tests/conftest.py's runner checks every run)."""

from __future__ import annotations

import pytest

from tokenmill.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
# Each drafter's tree, and the mean accepted length its greedy run must beat: the shipped
# EAGLE head accepts more than the Medusa heads.
DRAFTERS = {
    "medusa": ({"speculative_method": "medusa", "num_speculative_tokens": 8}, 1.05),
    "eagle": (
        {"speculative_method": "eagle", "num_speculative_tokens": 8, "speculative_tree": True},
        1.3,
    ),
}


@pytest.fixture(params=sorted(DRAFTERS))
def drafter(request) -> tuple[dict, float]:
    return DRAFTERS[request.param]


def test_greedy_tokens_equal_plain_decoding_and_tree_paths_are_accepted(runner, drafter):
    tree, min_accepted_length = drafter
    prompts = [
        runner.chat("Explain how a refrigerator keeps food cold."),
        runner.chat("Write a haiku about autumn."),
    ]
    expected = runner.tokens(prompts, GREEDY)
    engine = runner.engine(**tree)
    outputs = runner.run(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    metrics = outputs[0].metrics.spec_decode
    assert metrics.num_verify_steps > 0
    assert metrics.mean_accepted_length > min_accepted_length


def test_a_score_floor_verifies_fewer_drafts_and_keeps_greedy_tokens(runner, drafter):
    tree, _ = drafter
    prompts = [runner.chat("Explain how a refrigerator keeps food cold.")]
    expected = runner.tokens(prompts, GREEDY)
    drafts = {}
    for min_score in (0.0, 0.05):
        engine = runner.engine(**tree, speculative_tree_min_score=min_score)
        outputs = runner.run(engine, prompts, GREEDY)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        metrics = outputs[0].metrics.spec_decode
        drafts[min_score] = metrics.num_draft_tokens / metrics.num_verify_steps
    assert drafts[0.05] < drafts[0.0]


def test_greedy_batch_of_eight_with_trees_equals_plain_decoding(runner, drafter):
    tree, _ = drafter
    topics = ("rivers", "owls", "clocks", "bread", "tides", "chess", "bees", "maps")
    prompts = [runner.chat(f"Tell me about {topic}.") for topic in topics]
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = runner.tokens(prompts, params)
    engine = runner.engine(**tree, speculative_disable_batch_size=8)
    assert [o.outputs[0].token_ids for o in runner.run(engine, prompts, params)] == expected
    assert engine.scheduler.stats.num_verify_steps > 0


def test_seeded_sampling_with_trees_equals_plain_decoding_across_preemption(runner, drafter):
    tree, _ = drafter
    prompts = [runner.chat(f"Tell me about {topic}.") for topic in ("rivers", "owls", "clocks")]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16)
    expected = runner.tokens(prompts, params)
    memory = 5 * 16 * runner.engine(**tree).kv_bytes_per_token
    engine = runner.engine(**tree, kv_cache_memory=memory)
    outputs = runner.run(engine, prompts, params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.stats.num_verify_steps > 0
    assert [out.outputs[0].token_ids for out in outputs] == expected
