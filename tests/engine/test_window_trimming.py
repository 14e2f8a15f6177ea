"""Gemma 3 with window trimming (its 15 sliding-window layers hold only their window's blocks):
the same greedy tokens as with one block table for all layers, through chunked prefill,
preemption and prefix-cache hits, and no block leaked."""

from __future__ import annotations

import pytest

from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling.params import SamplingParams

from .test_engine import make_engine, random_prompt, run_all, tokens

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = [random_prompt(300 + i, 700) for i in range(4)]  # longer than the 512-token window


def assert_no_blocks_held(engine: LLMEngine) -> None:
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def blocks_held_per_group(engine: LLMEngine, request_id: str) -> list[int]:
    return [group.num_blocks_held(request_id) for group in engine.kv_manager.groups]


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    return random_prompt(29, 3000)


@pytest.fixture(scope="module")
def long_run_trimmed(gemma, long_prompt):
    """The long prompt with trimming: its greedy tokens, and each group's blocks after every
    step but the last (the prompt takes two: the token budget is 2048)."""
    engine = make_engine(gemma)
    engine.add_request("long", long_prompt, LONG)
    held: list[list[int]] = []
    result = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                result = output.outputs[0].token_ids
        if engine.has_unfinished_requests():
            held.append(blocks_held_per_group(engine, "long"))
    assert_no_blocks_held(engine)
    return result, held


@pytest.fixture(scope="module")
def untrimmed(gemma) -> list[list[int]]:
    return tokens(run_all(make_engine(gemma, kv_window_trimming=False), PROMPTS, SHORT))


def test_long_prompt_greedy_tokens_equal_untrimmed(gemma, long_prompt, long_run_trimmed):
    engine = make_engine(gemma, kv_window_trimming=False)
    expected = tokens(run_all(engine, [long_prompt], LONG))[0]
    assert long_run_trimmed[0] == expected


def test_sliding_groups_hold_the_window_not_the_sequence(gemma, long_run_trimmed):
    engine = make_engine(gemma)
    window, block = gemma.config.sliding_window, engine.args.block_size
    assert engine.kv_groups.windows == (None, window, window, window, window, window)
    held = long_run_trimmed[1]
    assert len(held) == LONG.max_tokens  # two prompt chunks, then a decode a step
    assert held[0] == [2048 // block] * 6  # a chunk reads all of itself
    after_prompt = held[2:]
    assert all(n <= -(-(window - 1) // block) + 1 for step in after_prompt for n in step[1:])
    assert held[-1][0] == -(-(3000 + LONG.max_tokens - 2) // block)  # the full group: all


def test_chunked_prefill_gives_the_same_tokens(gemma, untrimmed):
    engine = make_engine(gemma, max_num_batched_tokens=128)  # later chunks read trimmed tables
    assert tokens(run_all(engine, PROMPTS, SHORT)) == untrimmed
    assert_no_blocks_held(engine)


def test_preempted_requests_resume_with_the_same_tokens(gemma):
    # Prompts just inside the window: four fill the pool, the first decoded block preempts,
    # and decoding then crosses the window, so resumed requests trim too.
    prompts = [random_prompt(400 + i, 480) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = tokens(run_all(make_engine(gemma, kv_window_trimming=False), prompts, params))
    probe = make_engine(gemma)
    small = make_engine(gemma, kv_cache_memory=(4 * 30 * 6 + 11) * probe.kv_block_bytes)
    assert tokens(run_all(small, prompts, params)) == expected
    assert small.scheduler.stats.num_preemptions > 0
    assert_no_blocks_held(small)


def test_prefix_cache_hits_give_the_same_tokens(gemma, untrimmed):
    engine = make_engine(gemma)
    first = run_all(engine, PROMPTS[:1], SHORT)
    again = run_all(engine, [PROMPTS[0]], SHORT)  # the whole prompt but its last block, cached
    assert again[0].num_cached_tokens == (700 - 1) // 16 * 16
    assert tokens(first) == tokens(again) == untrimmed[:1]
    assert_no_blocks_held(engine)
