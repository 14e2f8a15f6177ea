"""The engine on the real SmolLM2 model: every KV mode, batching, chunking, preemption and prefix
reuse give the same greedy tokens as the simplest path, and no KV block is leaked."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.kv.layout import kv_bytes_per_token
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.request import FinishReason
from tokenmill.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

VARIED_PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
    "The chemical symbol for gold is",
    "Translate to French: good morning",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
    "In 1969, the first humans",
    "Dear hiring manager,",
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name FROM users WHERE",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8,",
    "The weather today is",
]


def make_engine(loaded: LoadedModel, **kwargs) -> LLMEngine:
    args = EngineArgs(model=str(loaded.path), **{"kv_cache_memory": "256MiB", **kwargs})
    return LLMEngine(args, loaded=loaded)


def run_all(engine: LLMEngine, prompts, params=GREEDY, max_steps=5000) -> list[RequestOutput]:
    ids = [f"req-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert not engine.has_unfinished_requests(), "engine stopped making progress"
    return [done[request_id] for request_id in ids]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def smollm_kv_bytes(loaded: LoadedModel) -> int:
    return kv_bytes_per_token(loaded.config, torch.float32)


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


def assert_no_blocks_held(engine: LLMEngine) -> None:
    assert engine.kv_manager is not None
    assert engine.kv_manager.pool.num_free_blocks == engine.num_blocks


@pytest.fixture(scope="module")
def alone(smollm) -> list[list[int]]:
    """Greedy tokens of each varied prompt run on its own, the reference for batching."""
    engine = make_engine(smollm)
    return [tokens(run_all(engine, [prompt]))[0] for prompt in VARIED_PROMPTS]


def test_batched_greedy_outputs_equal_each_prompt_run_alone(smollm, alone):
    engine = make_engine(smollm)
    assert tokens(run_all(engine, VARIED_PROMPTS)) == alone
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "paged"])
def test_every_kv_cache_mode_gives_the_same_greedy_tokens(smollm, alone, kv_cache):
    engine = make_engine(smollm, kv_cache=kv_cache, max_model_len=256)
    assert tokens(run_all(engine, VARIED_PROMPTS[:4])) == alone[:4]


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_batch_policies_give_the_same_tokens(smollm, alone, scheduler):
    engine = make_engine(smollm, scheduler=scheduler, max_num_seqs=4)
    assert tokens(run_all(engine, VARIED_PROMPTS)) == alone


def test_preempted_requests_resume_with_identical_tokens(smollm):
    prompts = [random_prompt(seed, 40) for seed in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = tokens(run_all(make_engine(smollm), prompts, params))
    small = make_engine(smollm, kv_cache_memory=24 * 16 * smollm_kv_bytes(smollm))
    assert tokens(run_all(small, prompts, params)) == expected
    assert small.scheduler.stats.num_preemptions > 0
    assert_no_blocks_held(small)


def test_seeded_sampling_survives_preemption(smollm):
    prompts = [random_prompt(seed, 40) for seed in range(6)]
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=40, ignore_eos=True)
    expected = tokens(run_all(make_engine(smollm), prompts, params))
    small = make_engine(smollm, kv_cache_memory=24 * 16 * smollm_kv_bytes(smollm))
    assert tokens(run_all(small, prompts, params)) == expected
    assert small.scheduler.stats.num_preemptions > 0


def test_chunked_prefill_of_a_long_prompt_equals_unchunked(smollm):
    prompt = random_prompt(7, 2000)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = make_engine(smollm, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chunked = make_engine(smollm, max_num_batched_tokens=256, enable_prefix_caching=False)
    assert tokens(run_all(chunked, [prompt], params)) == tokens(run_all(whole, [prompt], params))


def test_shared_prefix_is_served_from_the_cache(smollm):
    prefix = random_prompt(11, 1024)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = make_engine(smollm)
    first = run_all(engine, [[*prefix, 500, 501, 502]], params)[0]
    second = run_all(engine, [[*prefix, 600, 601]], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 1008
    cold = make_engine(smollm, enable_prefix_caching=False)
    assert second.outputs[0].token_ids == tokens(run_all(cold, [[*prefix, 600, 601]], params))[0]


def test_preempted_request_that_rehits_the_prefix_cache_resumes_correctly(smollm):
    shared = random_prompt(5, 64)
    prompts = [shared + random_prompt(100 + i, 8) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = tokens(run_all(make_engine(smollm, enable_prefix_caching=False), prompts, params))
    small = make_engine(smollm, kv_cache_memory=18 * 16 * smollm_kv_bytes(smollm))
    outputs = run_all(small, prompts, params)
    assert tokens(outputs) == expected
    assert small.scheduler.stats.num_preemptions > 0
    assert any(out.num_cached_tokens > 0 for out in outputs)
    assert_no_blocks_held(small)


@pytest.mark.parametrize("length", [15, 16, 17, 31, 32, 33])
def test_prompts_at_block_boundaries_match_the_no_cache_baseline(smollm, length):
    prompt = random_prompt(length, length)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # crosses a boundary
    baseline = make_engine(smollm, kv_cache="none")
    paged = make_engine(smollm)
    assert tokens(run_all(paged, [prompt], params)) == tokens(run_all(baseline, [prompt], params))


def test_n_samples_share_the_prompt_blocks_and_differ(smollm):
    engine = make_engine(smollm)
    prompt = random_prompt(3, 40)  # two full blocks and a partial one
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    engine.add_request("multi", prompt, params)
    engine.step()  # the parent computes the prompt; its siblings wait
    assert [child.request_id for child in engine.scheduler.running] == ["multi#0"]
    engine.step()  # they fork it, and each copies the partial block before writing into it
    children = engine.scheduler.running
    assert len(children) == 3
    tables = [engine.kv_manager.block_ids(child.request_id) for child in children]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({table[2] for table in tables}) == 3
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
    (result,) = outputs
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in result.outputs}) > 1
    assert_no_blocks_held(engine)


def run_n_with_counts(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[RequestOutput, dict[str, int], int]:
    """The request's output, the prompt positions each child computed, the blocks copied."""
    computed: dict[str, int] = {}
    num_copies = 0
    execute = engine.runner.execute

    def counting(out):
        nonlocal num_copies
        num_copies += len(out.block_copies)
        for item in out.scheduled:
            start = item.num_computed_tokens
            stop = min(start + item.num_new_tokens, len(prompt))
            computed[item.request.request_id] = computed.get(item.request.request_id, 0)
            computed[item.request.request_id] += max(stop - start, 0)
        return execute(out)

    engine.runner.execute = counting
    (out,) = run_all(engine, [prompt], params)
    return out, computed, num_copies


@pytest.mark.parametrize(("length", "num_copies"), [(40, 3), (32, 3), (33, 0)])
def test_n_samples_compute_the_prompt_once(smollm, length, num_copies):
    """The parent computes the prompt; each sibling only its last token, into a copy of the
    partial block (none when that token starts a new block)."""
    engine = make_engine(smollm)
    params = SamplingParams(n=4, temperature=0, max_tokens=4, ignore_eos=True)
    _, computed, copies = run_n_with_counts(engine, random_prompt(length, length), params)
    assert computed == {"req-0#0": length, "req-0#1": 1, "req-0#2": 1, "req-0#3": 1}
    assert copies == num_copies
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("length", [40, 32])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_n_samples_equal_each_child_run_alone(smollm, length, temperature):
    prompt = random_prompt(100 + length, length)
    params = SamplingParams(n=4, temperature=temperature, seed=9, max_tokens=12, ignore_eos=True)
    shared = make_engine(smollm)
    (out,) = run_all(shared, [prompt], params)
    alone = make_engine(smollm, enable_prefix_caching=False)
    for index, child in enumerate(out.outputs):
        single = dataclasses.replace(params, n=1, seed=params.seed + index)
        assert child.token_ids == tokens(run_all(alone, [prompt], single))[0]
    assert_no_blocks_held(shared)


@pytest.mark.parametrize(("child", "after_steps"), [(0, 1), (1, 3), (None, 3)])
def test_abort_of_one_child_or_all_mid_run_leaks_no_block(smollm, child, after_steps):
    """Child 0 aborted after one step: its siblings had not forked yet and compute the prompt
    from the prefix cache; child 1 aborted after forking; or the whole request."""
    engine = make_engine(smollm)
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=10, ignore_eos=True)
    engine.add_request("multi", random_prompt(4, 40), params)
    for _ in range(after_steps):
        engine.step()
    if child is None:
        engine.abort_request("multi")
    else:
        engine.scheduler.finish_requests([f"multi#{child}"], FinishReason.ABORT)
        engine.runner.release(f"multi#{child}")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
    survivors = [] if child is None else [c for c in outputs[0].outputs if c.index != child]
    assert all(len(c.token_ids) == params.max_tokens for c in survivors)
    assert_no_blocks_held(engine)


def test_preempted_n_samples_resume_with_identical_tokens(smollm):
    prompts = [random_prompt(seed, 40) for seed in range(3)]
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=40, ignore_eos=True)
    expected = run_all(make_engine(smollm), prompts, params)
    small = make_engine(smollm, kv_cache_memory=16 * 16 * smollm_kv_bytes(smollm))
    outputs = run_all(small, prompts, params)
    assert small.scheduler.stats.num_preemptions > 0
    for out, ref in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert_no_blocks_held(small)


def test_n_samples_copy_the_draft_models_own_kv_too(smollm):
    """A draft model with its own paged KV that is the target itself: a sibling whose copied
    block lacked the draft's KV would draft wrongly and see its drafts rejected."""
    draft = {"speculative_method": "draft", "draft_model": str(smollm.path)}
    prompt = random_prompt(6, 40)
    params = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    engine = make_engine(smollm, **draft)
    (out,) = run_all(engine, [prompt], params)
    (plain,) = run_all(make_engine(smollm), [prompt], params)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0
    assert_no_blocks_held(engine)


def test_abort_frees_blocks_at_once(smollm):
    engine = make_engine(smollm)
    engine.add_request("a", random_prompt(1, 50), SamplingParams(max_tokens=100))
    engine.step()
    assert engine.kv_manager.pool.num_free_blocks < engine.num_blocks
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert_no_blocks_held(engine)


def test_stop_string_is_cut_from_the_text(smollm):
    engine = make_engine(smollm)
    full = run_all(engine, ["The capital of France is"])[0].outputs[0].text
    stop = full[3:6]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = run_all(engine, ["The capital of France is"], params)[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_string_spanning_a_token_boundary_is_cut(smollm):
    engine = make_engine(smollm)
    free = run_all(engine, ["The capital of France is"])[0].outputs[0]
    pieces = [engine.tokenizer.decode([t]) for t in free.token_ids]
    cut = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 2)
    stop = pieces[cut - 1][-2:] + pieces[cut][:2]  # two characters from each of two tokens
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = run_all(engine, ["The capital of France is"], params)[0].outputs[0]
    assert out.text == free.text[: free.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) == cut + 1  # generation ended with the token that completed it


def test_max_tokens_ends_with_reason_length(smollm):
    out = run_all(make_engine(smollm), ["Hello"], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length"


def test_stop_token_id_ends_generation_with_reason_stop(smollm):
    engine = make_engine(smollm)
    free = run_all(engine, ["Hello"])[0].outputs[0].token_ids
    stop_id = free[3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    out = run_all(engine, ["Hello"], params)[0].outputs[0]
    assert out.token_ids == free[: free.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_greedy_logprobs_rank_the_chosen_token_first(smollm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    out = run_all(make_engine(smollm), ["Hello"], params)[0].outputs[0]
    assert [entry.token_id for entry in out.logprobs] == out.token_ids
    assert all(entry.rank == 1 and len(entry.top) == 2 for entry in out.logprobs)
    assert out.cumulative_logprob == pytest.approx(sum(entry.logprob for entry in out.logprobs))


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "at least one token"),
        ([1, 2, 10**9], "prompt_token_ids"),
        ({"text": "x"}, "prompt_token_ids"),
    ],
)
def test_bad_prompts_raise_a_clear_error_and_leak_nothing(smollm, prompt, message):
    engine = make_engine(smollm)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, GREEDY)
    assert not engine.has_unfinished_requests()


def test_a_reused_request_id_is_refused_without_disturbing_the_first(smollm):
    engine = make_engine(smollm)
    engine.add_request("same", "Hello", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", "Other", GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
    assert [out.prompt for out in outputs] == ["Hello"]
    assert len(outputs[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_prompt_longer_than_the_context_names_both_numbers(smollm):
    engine = make_engine(smollm, max_model_len=64)
    with pytest.raises(ValueError, match="100 tokens.*64"):
        engine.add_request("long", random_prompt(0, 100), GREEDY)


def test_contiguous_pool_too_small_for_one_reservation_fails_at_construction(smollm):
    with pytest.raises(ValueError, match="contiguous.*max_model_len=8192"):
        make_engine(smollm, kv_cache="contiguous", kv_cache_memory="64MiB")


# --- prompt logprobs --------------------------------------------------------------------------


def prompt_logprobs_of(
    engine: LLMEngine, prompts, num_top: int = 2, max_tokens: int = 2
) -> list[RequestOutput]:
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=num_top
    )
    return run_all(engine, prompts, params)


def test_prompt_logprobs_equal_a_full_transformers_forward(smollm, hf_smollm):
    prompt = random_prompt(21, 50)
    (out,) = prompt_logprobs_of(make_engine(smollm), [prompt], num_top=3)
    with torch.inference_mode():
        reference = hf_smollm(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        expected = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(expected[prompt[position]].item(), abs=1e-3)
        # Ranks and top-N orders of near-ties may differ by float noise: bound them instead.
        chosen = expected[prompt[position]]
        assert (expected > chosen + 1e-3).sum() < entry.rank <= (expected > chosen - 1e-3).sum() + 1
        top = expected.topk(3)
        assert [value for _, value in entry.top] == pytest.approx(top.values.tolist(), abs=1e-3)


def test_prompt_logprobs_survive_chunking_prefix_cache_hits_and_no_cache(smollm):
    prompt = random_prompt(22, 70)
    (alone,) = prompt_logprobs_of(make_engine(smollm), [prompt])
    chunked = make_engine(smollm, max_num_batched_tokens=16)
    first, again = prompt_logprobs_of(chunked, [prompt, prompt])
    (uncached,) = prompt_logprobs_of(make_engine(smollm, kv_cache="none"), [prompt])
    expected = [entry.logprob for entry in alone.prompt_logprobs[1:]]
    for out in (first, again, uncached):
        assert out.num_cached_tokens == 0  # cached prompt positions would have no logprobs
        assert [entry.logprob for entry in out.prompt_logprobs[1:]] == pytest.approx(
            expected, abs=1e-4
        )
    assert_no_blocks_held(chunked)


def test_prompt_logprobs_are_scored_once_across_preemption(smollm):
    prompts = [random_prompt(seed, 40) for seed in range(6)]
    expected = prompt_logprobs_of(make_engine(smollm), prompts, max_tokens=40)
    small = make_engine(smollm, kv_cache_memory=24 * 16 * smollm_kv_bytes(smollm))
    outputs = prompt_logprobs_of(small, prompts, max_tokens=40)
    assert small.scheduler.stats.num_preemptions > 0
    for out, ref in zip(outputs, expected, strict=True):
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == 40
        assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-4
        )


def test_n_samples_report_the_prompt_logprobs_once(smollm):
    prompt = random_prompt(23, 20)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=0)
    (out,) = run_all(make_engine(smollm), [prompt], params)
    assert len(out.outputs) == 3
    assert len(out.prompt_logprobs) == len(prompt)
    assert all(entry.top == [] for entry in out.prompt_logprobs[1:])


def test_prepacked_weights_give_the_same_greedy_tokens(smollm):
    """Sixteen prompts prefill together (over a hundred rows: the prepacked products)."""
    plain = run_all(make_engine(smollm, prepack_weights=False), VARIED_PROMPTS)
    packed = run_all(make_engine(smollm, prepack_weights=True), VARIED_PROMPTS)
    assert [o.outputs[0].token_ids for o in packed] == [o.outputs[0].token_ids for o in plain]
