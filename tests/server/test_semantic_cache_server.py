"""The semantic response cache behind the OpenAI endpoints: what it serves, what it never
serves, and how a hit looks to a client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tokenmill.gateway.cache_store import CacheStore
from tokenmill.gateway.embedding import packaged_embedder
from tokenmill.gateway.semantic_cache import CacheSettings, SemanticCache
from tokenmill.loader.model_loader import LoadedModel

SMOLLM, GEMMA = "smollm2-135m-instruct", "gemma3-270m"


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, gemma: LoadedModel, serve_engines) -> Iterator:
    engines = {
        SMOLLM: serve_engines.engine(smollm, kv_cache_memory="64MiB"),
        GEMMA: serve_engines.engine(gemma, kv_cache_memory="64MiB"),
    }
    cache = SemanticCache(CacheSettings(), packaged_embedder())
    with serve_engines(engines, semantic_cache=cache) as live:
        yield live


def ask(server, question: str, model: str = SMOLLM, system: str | None = None, **fields):
    messages = [{"role": "user", "content": question}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}
    with server.http() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def answer(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def test_a_repeated_question_is_an_exact_hit_with_the_same_answer(server):
    first = ask(server, "What is the capital of France?")
    again = ask(server, "  what is the capital of   FRANCE?")
    assert "x-tokenmill-cache" not in first.headers
    assert again.headers["x-tokenmill-cache"] == "exact"
    assert answer(again) == answer(first)


def test_a_paraphrase_is_a_semantic_hit(server):
    first = ask(server, "How should I boil an egg?")
    again = ask(server, "How do I boil an egg?")
    assert again.headers["x-tokenmill-cache"] == "semantic"
    assert answer(again) == answer(first)


def test_a_near_miss_with_another_number_is_not_a_hit(server):
    ask(server, "What is 12+7?")
    assert "x-tokenmill-cache" not in ask(server, "What is 12+8?").headers


def test_a_hit_never_crosses_system_prompts(server):
    ask(server, "Name a colour.", system="Answer in French.")
    assert "x-tokenmill-cache" not in ask(server, "Name a colour.", system="Be brief.").headers


def test_a_hit_never_crosses_models(server):
    ask(server, "Name a planet.", model=SMOLLM)
    other = ask(server, "Name a planet.", model=GEMMA)
    assert "x-tokenmill-cache" not in other.headers
    assert other.json()["model"] == GEMMA


def test_a_sampled_request_is_served_only_when_it_opts_in(server):
    sampled = {"temperature": 0.8, "seed": 7}
    ask(server, "Name an animal.", **sampled)
    assert "x-tokenmill-cache" not in ask(server, "Name an animal.", **sampled).headers
    ask(server, "Name a tree.", semantic_cache=True, **sampled)
    hit = ask(server, "Name a tree.", semantic_cache=True, **sampled)
    assert hit.headers["x-tokenmill-cache"] == "exact"


def test_a_request_that_opts_out_is_never_served_from_the_cache(server):
    ask(server, "Name a river.")
    assert "x-tokenmill-cache" not in ask(server, "Name a river.", semantic_cache=False).headers


def stream_events(server, question: str) -> tuple[dict, list[dict]]:
    body = {
        "model": SMOLLM,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with server.http() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        headers = dict(r.headers)
    assert events[-1] == "[DONE]"
    return headers, [json.loads(e) for e in events[:-1]]


def shape(chunks: list[dict]) -> list:
    """What a client reads from the chunks, without their id and time."""
    return [(c["choices"], c.get("usage")) for c in chunks]


def test_a_hit_streams_in_the_chunks_the_answer_was_generated_in(server):
    generated_headers, generated = stream_events(server, "Name a mountain.")
    hit_headers, replayed = stream_events(server, "Name a mountain.")
    assert "x-tokenmill-cache" not in generated_headers
    assert hit_headers["x-tokenmill-cache"] == "exact"
    assert shape(replayed) == shape(generated)
    content = [c for c in replayed if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) >= 2
    assert replayed[-1]["usage"]["completion_tokens"] >= 2


def test_a_hit_on_a_streamed_answer_serves_a_plain_request_the_same_text(server):
    _, generated = stream_events(server, "Name a lake.")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in generated if c["choices"])
    hit = ask(server, "Name a lake.", max_tokens=6)
    assert hit.headers["x-tokenmill-cache"] == "exact"
    assert answer(hit) == text


def test_metrics_count_hits_per_tier_and_misses(server):
    ask(server, "Name a city in Italy.")
    ask(server, "Name a city in Italy.")
    assert server.metric_with_labels("tokenmill_semantic_cache_hits_total", tier="exact") >= 1
    assert server.metric_with_labels("tokenmill_semantic_cache_misses_total") >= 1
    assert server.metric_with_labels("tokenmill_semantic_cache_lookup_seconds_count") >= 2


def test_without_the_cache_a_repeat_runs_again(server, smollm, serve_engines):
    with serve_engines({SMOLLM: serve_engines.engine(smollm, kv_cache_memory="64MiB")}) as plain:
        ask(plain, "What is the capital of France?")
        again = ask(plain, "What is the capital of France?")
        with plain.http() as client:
            metrics = client.get("/metrics").text
    assert "x-tokenmill-cache" not in again.headers
    assert "semantic_cache" not in metrics


def test_a_restarted_server_hits_what_the_last_one_cached(smollm, serve_engines, tmp_path):
    def persistent_server():
        cache = SemanticCache(CacheSettings(), packaged_embedder(), store=CacheStore(path))
        engine = serve_engines.engine(smollm, kv_cache_memory="64MiB")
        return serve_engines({SMOLLM: engine}, semantic_cache=cache)

    path = tmp_path / "cache.sqlite"
    with persistent_server() as first:
        generated = answer(ask(first, "How do I boil an egg?"))
    with persistent_server() as second:
        assert second.metric_with_labels("tokenmill_semantic_cache_entries") == 1
        exact = ask(second, "How do I boil an egg?")
        semantic = ask(second, "How should I boil an egg?")
    assert exact.headers["x-tokenmill-cache"] == "exact"
    assert semantic.headers["x-tokenmill-cache"] == "semantic"
    assert answer(exact) == answer(semantic) == generated
