"""POST /v1/chat/completions through the official openai client against a live server."""

from __future__ import annotations

import openai
import pytest

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling.params import SamplingParams

MODEL = "smollm2-135m-instruct"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def offline(smollm) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(smollm.path), kv_cache_memory="64MiB"), loaded=smollm)


def offline_chat(engine: LLMEngine, params: SamplingParams) -> str:
    """The synchronous engine on the chat-templated prompt, as LLM.chat renders it."""
    text = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    engine.add_request("offline", {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output.outputs[0].text
    raise AssertionError("the engine finished nothing")


def test_greedy_reply_equals_the_offline_engine(client, offline):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == offline_chat(
        offline, SamplingParams(temperature=0, max_tokens=12)
    )
    assert choice.finish_reason in ("stop", "length")
    assert response.object == "chat.completion"
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )


def test_stream_opens_with_the_role_and_adds_up_to_the_reply(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    *content, usage_chunk = chunks
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_max_completion_tokens_wins_over_max_tokens(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_logprobs_cover_every_token_with_top_alternatives(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode() == entry.token


def test_n2_seeded_replies_are_reproducible(client):
    def sample() -> list[str]:
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, max_tokens=10, temperature=1.0, seed=3
        )
        assert [c.index for c in response.choices] == [0, 1]
        return [c.message.content for c in response.choices]

    first = sample()
    assert sample() == first
    assert first[0] != first[1]


def test_stop_string_ends_the_reply_before_it(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    text = whole.choices[0].message.content
    stop = text[2:5]
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stop=stop
    )
    assert response.choices[0].message.content == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_content_parts_are_joined_into_one_message(client):
    parts = [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]
    as_parts = client.chat.completions.create(
        model=MODEL,
        messages=[MESSAGES[0], {"role": "user", "content": parts}],
        max_tokens=6,
        temperature=0,
    )
    as_text = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
