"""Speculative decoding wired into the engine, on the real SmolLM2 model: every method leaves
greedy output unchanged; rejected drafts leave no stale KV; n > 1, seeds, prefix caching,
preemption, stop conditions and logprobs behave as in plain decoding."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineArgs
from tokenmill.loader.resolve import DEFAULT_MODEL
from tokenmill.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
METHODS = {
    "ngram": {"speculative_method": "ngram"},
    "early-exit": {"speculative_method": "draft", "draft_model": "self:layers=24"},
    "int4-copy": {
        "speculative_method": "draft",
        "draft_model": DEFAULT_MODEL,
        "draft_quantization": "int4",
    },
}


@pytest.fixture(scope="module")
def prompts(runner, rewrite_prompt) -> list:
    return [
        rewrite_prompt,
        runner.chat("Name three rivers in Europe."),
        "def fibonacci(n):",
        [1, 2, 3, 1, 2, 3, 1, 2],
    ]


@pytest.fixture(scope="module")
def expected(runner, prompts) -> list[list[int]]:
    return runner.tokens(prompts, GREEDY)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_equal_plain_decoding(runner, prompts, expected, method):
    assert runner.tokens(prompts, GREEDY, **METHODS[method]) == expected


def test_target_as_its_own_draft_model_accepts_nearly_everything(runner, prompts, expected):
    """A separate draft model with its own paged KV; being the target itself, any stale or
    misplaced draft KV would show up as rejections."""
    engine = runner.engine(speculative_method="draft", draft_model=str(runner.loaded.path))
    outputs = runner.run(engine, prompts[:2], GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected[:2]
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0


def test_an_int4_copy_of_the_target_drafts_without_changing_greedy_output(
    runner, prompts, expected
):
    """The target's own checkpoint quantized at load time: a cheaper model that disagrees with
    the target now and then, whose drafts must leave the output the target's."""
    engine = runner.engine(
        speculative_method="draft", draft_model=str(runner.loaded.path), draft_quantization="int4"
    )
    assert engine.runner.proposer.decode_loop is not None
    outputs = runner.run(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens >= 0.5 * stats.num_draft_tokens > 0


def test_drawn_drafts_are_accepted_far_more_often_than_argmax_ones_when_sampling(
    runner, prompts, expected
):
    """At temperature 1 an argmax draft is accepted with the target's probability of it; a
    draft drawn from the int4 copy's distribution, verified against that distribution, nearly
    always. Greedy requests still draft argmaxes and emit plain decoding's tokens, and a
    seeded request's drawn drafts repeat run to run."""
    sampled = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
    acceptance, outputs = {}, {}
    for mode in ("argmax", "sample", "sample again"):
        engine = runner.engine(**METHODS["int4-copy"], draft_sampling=mode.split()[0])
        outputs[mode] = [out.outputs[0].token_ids for out in runner.run(engine, prompts, sampled)]
        stats = engine.scheduler.stats
        acceptance[mode] = stats.num_accepted_tokens / stats.num_draft_tokens
    assert acceptance["sample"] > 0.75 and acceptance["argmax"] < acceptance["sample"] - 0.2
    assert outputs["sample"] == outputs["sample again"]
    greedy = runner.tokens(prompts, GREEDY, **METHODS["int4-copy"], draft_sampling="sample")
    assert greedy == expected


def test_a_draft_model_recomputes_only_the_tokens_its_fed_drafts_did_not_cover(
    runner, rewrite_prompt
):
    """Feeding drafts back wrote their KV, right for every draft the target accepted: after
    the prompt, a catch-up runs the last draft (never fed) and the target's own next token, not
    every token the target verified."""
    engine = runner.engine(speculative_method="draft", draft_model=str(runner.loaded.path))
    proposer = engine.runner.proposer
    chunk_sizes: list[int] = []
    forward = proposer._forward

    def recording_forward(chunks):
        chunk_sizes.extend(chunk.end - chunk.start for chunk in chunks)
        return forward(chunks)

    proposer._forward = recording_forward
    runner.run(engine, [rewrite_prompt], GREEDY)
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens > 2 * stats.num_verify_steps  # runs of accepted drafts
    assert chunk_sizes[0] == len(rewrite_prompt) + 1  # the prompt and the first token
    assert max(chunk_sizes[1:]) <= 2


def test_a_draft_model_drafts_the_same_tokens_through_the_native_loop_as_in_python(runner, prompts):
    stats = []
    for loop in ("native", "python"):
        engine = runner.engine(
            speculative_method="draft", draft_model="self:layers=24", decode_loop=loop
        )
        assert (engine.runner.proposer.decode_loop is None) == (loop == "python")
        runner.run(engine, prompts, GREEDY)
        stats.append(
            (engine.scheduler.stats.num_draft_tokens, engine.scheduler.stats.num_accepted_tokens)
        )
    assert stats[0] == stats[1]
    assert stats[0][1] > 0


def test_kv_pool_also_holds_the_draft_models_kv(runner):
    plain = runner.engine()
    own_kv = runner.engine(speculative_method="draft", draft_model=str(runner.loaded.path))
    shared_kv = runner.engine(speculative_method="draft", draft_model="self:layers=8")
    assert own_kv.kv_bytes_per_token == 2 * plain.kv_bytes_per_token
    assert shared_kv.kv_bytes_per_token == plain.kv_bytes_per_token
    assert own_kv.num_blocks == plain.num_blocks // 2


def test_after_rejections_the_cached_kv_continues_like_a_fresh_run(runner, prompts):
    """An early exit from layer 8 drafts badly, so most drafts are rejected and rolled back.
    A follow-up request then reuses the blocks the speculative run left in the prefix cache;
    its continuation must equal a fresh engine's."""
    engine = runner.engine(speculative_method="draft", draft_model="self:layers=8")
    (first,) = runner.run(engine, [prompts[1]], GREEDY)
    spec = first.metrics.spec_decode
    assert spec.num_draft_tokens > spec.num_accepted_tokens
    follow_up = [*first.prompt_token_ids, *first.outputs[0].token_ids]
    (again,) = runner.run(engine, [follow_up], GREEDY)
    assert again.num_cached_tokens >= len(follow_up) - 16
    assert again.outputs[0].token_ids == runner.tokens([follow_up], GREEDY)[0]


@pytest.mark.parametrize("method", METHODS)
def test_preempted_requests_resume_with_identical_tokens(runner, prompts, expected, method):
    # Ten blocks: too few for every request at once, enough for the longest alone. A draft
    # model with KV of its own needs its share of every block too.
    per_token = runner.engine(**METHODS[method]).kv_bytes_per_token
    engine = runner.engine(kv_cache_memory=10 * 16 * per_token, **METHODS[method])
    outputs = runner.run(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert engine.scheduler.stats.num_preemptions > 0


def test_seeded_samples_equal_plain_decoding_with_the_same_seed(runner, rewrite_prompt):
    """Drafts are checked against the token plain decoding would draw with the same random
    numbers, so a seeded request's samples do not depend on speculation."""
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=5, n=2)
    plain = runner.run(runner.engine(), [rewrite_prompt], params)[0]
    spec = runner.run(runner.engine(speculative_method="ngram"), [rewrite_prompt], params)[0]
    samples = [seq.token_ids for seq in spec.outputs]
    assert samples == [seq.token_ids for seq in plain.outputs]
    assert samples[0] != samples[1]
    assert spec.metrics.spec_decode.num_accepted_tokens > 0


def test_stop_string_and_max_tokens_cut_the_output_as_plain_decoding_does(runner, rewrite_prompt):
    for params in (
        SamplingParams(temperature=0, max_tokens=30, stop=["Oxford"]),
        SamplingParams(
            temperature=0, max_tokens=30, stop=["Oxford"], include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0, max_tokens=7),
    ):
        plain = runner.run(runner.engine(), [rewrite_prompt], params)[0].outputs[0]
        spec = runner.run(runner.engine(speculative_method="ngram"), [rewrite_prompt], params)
        got = spec[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            plain.text,
            plain.token_ids,
            plain.finish_reason,
            plain.stop_reason,
        )


def test_logprobs_are_reported_for_every_accepted_token(runner, rewrite_prompt):
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    plain = runner.run(runner.engine(), [rewrite_prompt], params)[0].outputs[0]
    spec = runner.run(runner.engine(speculative_method="ngram"), [rewrite_prompt], params)
    got = spec[0].outputs[0]
    assert [e.token_id for e in got.logprobs] == got.token_ids == plain.token_ids
    for mine, theirs in zip(got.logprobs, plain.logprobs, strict=True):
        assert mine.rank == theirs.rank == 1
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)


def test_speculation_switches_off_above_the_batch_size(runner, prompts):
    engine = runner.engine(speculative_method="ngram", speculative_disable_batch_size=2)
    runner.run(engine, prompts[:3], SamplingParams(temperature=0, max_tokens=8))
    off = engine.scheduler.stats.num_verify_steps
    runner.run(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=8))
    assert off == 0 < engine.scheduler.stats.num_verify_steps


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speculative_method": "hydra"}, "speculative_method must be one of"),
        ({"speculative_method": "draft"}, "needs draft_model"),
        ({"draft_model": "self:layers=4"}, "needs speculative_method='draft'"),
        ({"speculative_method": "ngram", "draft_model": "x"}, "needs speculative_method"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative_method": "ngram", "kv_cache": "none"}, "needs a KV cache"),
        ({"speculative_method": "ngram", "draft_quantization": "int4"}, "draft_quantization"),
        ({"speculative_method": "ngram", "draft_sampling": "sample"}, "draft_sampling"),
        (
            {"speculative_method": "draft", "draft_model": "x", "draft_sampling": "top1"},
            "draft_sampling must be one of",
        ),
        (
            {"speculative_method": "draft", "draft_model": "x", "draft_quantization": "int3"},
            "draft_quantization must be one of",
        ),
        (
            {"speculative_method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
    ],
)
def test_bad_speculation_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_bad_draft_models_are_refused_at_construction(runner):
    with pytest.raises(ValueError, match="1 <= N < 30"):
        runner.engine(speculative_method="draft", draft_model="self:layers=30")
    with pytest.raises(ValueError, match="draft_quantization applies to a draft_model file"):
        runner.engine(
            speculative_method="draft", draft_model="self:layers=8", draft_quantization="int4"
        )
