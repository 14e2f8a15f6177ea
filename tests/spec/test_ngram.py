"""Prompt lookup: which drafts it proposes, and that greedy output is unchanged by it."""

from __future__ import annotations

from tokenmill.sampling.params import SamplingParams
from tokenmill.spec.ngram import propose_ngram

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def test_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 8, 2, 3]
    # [2, 3] occurs at 1 and 6; the latest earlier one (6) wins.
    assert propose_ngram(tokens, 3, min_n=1, max_n=2) == [4, 5, 6]
    # [8, 2, 3] never occurred before, so the 3-gram misses and the 2-gram is used.
    assert propose_ngram(tokens, 2, min_n=2, max_n=3) == [4, 5]


def test_longer_matches_take_precedence_over_later_shorter_ones():
    tokens = [5, 1, 2, 10, 11, 7, 2, 20, 5, 1, 2]
    assert propose_ngram(tokens, 2, min_n=1, max_n=3) == [10, 11]
    assert propose_ngram(tokens, 2, min_n=1, max_n=1) == [20, 5]


def test_no_recurring_suffix_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], 3, min_n=1, max_n=3) == []
    assert propose_ngram([1, 2, 1, 3], 3, min_n=2, max_n=3) == []
    assert propose_ngram([7], 3, min_n=1, max_n=3) == []


def test_drafts_stop_at_the_end_of_the_history():
    assert propose_ngram([4, 5, 6, 4, 5], 5, min_n=1, max_n=2) == [6, 4, 5]


def test_greedy_tokens_equal_plain_decoding_and_drafts_are_accepted(runner, rewrite_prompt):
    prompts = [rewrite_prompt, "The capital of France is", [1, 2, 3, 1, 2, 3, 1, 2]]
    expected = runner.tokens(prompts, GREEDY)
    engine = runner.engine(speculative_method="ngram")
    outputs = runner.run(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    spec = outputs[0].metrics.spec_decode
    assert spec.num_accepted_tokens > 0.5 * len(expected[0])
    assert engine.scheduler.stats.num_verify_steps > 0
