"""POST /v1/completions through the official openai client against a live server."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def add(a, b):"]


@pytest.fixture(scope="module")
def offline(smollm_path) -> LLM:
    return LLM(model=str(smollm_path), kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def test_greedy_text_equals_offline_generate(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [out.outputs[0].text for out in expected]
    assert response.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)
    assert response.usage.completion_tokens == sum(
        len(out.outputs[0].token_ids) for out in expected
    )
    assert response.object == "text_completion" and response.model == MODEL


def test_token_id_prompts_give_the_text_prompts_completion(client, offline):
    ids = [offline.tokenizer.encode(p) for p in PROMPTS]
    by_text = client.completions.create(prompt=PROMPTS, max_tokens=6, temperature=0, model=MODEL)
    by_ids = client.completions.create(prompt=ids, max_tokens=6, temperature=0, model=MODEL)
    single = client.completions.create(prompt=ids[1], max_tokens=6, temperature=0, model=MODEL)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert single.choices[0].text == by_text.choices[1].text


def test_stream_with_usage_adds_up_to_the_whole_completion(client):
    whole = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.total_tokens == whole.usage.total_tokens


def test_n2_seeded_samples_are_reproducible_and_distinct(client):
    def sample(seed: int) -> list[str]:
        response = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=12, temperature=1.0, seed=seed
        )
        assert [c.index for c in response.choices] == [0, 1]
        return [c.text for c in response.choices]

    first = sample(7)
    assert sample(7) == first
    assert first[0] != first[1]
    assert sample(8) != first


def test_stop_string_is_cut_and_never_streamed(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    text = greedy.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) > 0, f"no usable stop string in {text!r}"
    cut = text[: text.index(stop)]
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop]
    )
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == cut


def test_echo_with_max_tokens_0_returns_prompt_logprobs_as_lm_eval_reads_them(client, offline):
    """lm-eval's loglikelihood: echo, max_tokens=0, logprobs=1 over token-id prompts."""
    ids = offline.tokenizer.encode("Paris is the capital of France")
    response = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    (choice,) = response.choices
    expected = offline.generate(
        [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    )[0].prompt_logprobs
    assert choice.text == "Paris is the capital of France"
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-4)
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))
    ]
    for token, logprob, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert top[token] == logprob and max(top.values()) >= logprob


def test_echo_with_generation_puts_the_prompt_first(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    choice = response.choices[0]
    assert choice.text == PROMPTS[0] + plain.choices[0].text
    assert len(choice.logprobs.tokens) == response.usage.prompt_tokens + 3
    generated_top = choice.logprobs.top_logprobs[-3:]
    assert all(len(top) == 2 for top in generated_top)  # greedy: the chosen token is the top one


def test_streamed_echo_starts_with_the_prompt(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=4, echo=True, temperature=0, stream=True
        )
    )
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert chunks[0].choices[0].text.startswith(PROMPTS[0])
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0] + plain.choices[0].text


def test_32_concurrent_streams_all_finish_with_their_token_counts(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request number {i} says:",
            max_tokens=2 + i % 5,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        assert usage is not None
        return usage.completion_tokens, 2 + i % 5, finish

    async def main():
        async with client:
            return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(main())
    assert [got for got, _, _ in results] == [want for _, want, _ in results]
    assert {finish for _, _, finish in results} == {"length"}
    server.wait_until_idle()
