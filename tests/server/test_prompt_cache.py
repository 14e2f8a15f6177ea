"""Prompt caching over HTTP: usage.prompt_tokens_details.cached_tokens on both endpoints (streamed
usage too), the `cache.ttl` body field and its 400s, the disk tier's /metrics counters, and a
server restarted on the same offload directory serving its first prompt's prefix from disk."""

from __future__ import annotations

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
# Long enough for several full 16-token blocks.
SYSTEM = (
    "You are a careful assistant for a library. You answer questions about opening hours, "
    "loans, renewals, fines and the reading rooms, briefly and politely, in plain English."
)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with server.http() as client:
        yield client


def chat(question: str, **fields) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **fields}


def completion(prompt: str, **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}


def streamed_usage(http: httpx.Client, path: str, body: dict) -> dict:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=body) as response:
        events = [line[5:] for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1].strip() == "[DONE]"
    return httpx.Response(200, content=events[-2]).json()["usage"]


def test_chat_usage_counts_the_cached_prompt_tokens(http):
    first = http.post("/v1/chat/completions", json=chat("When do you open?")).json()["usage"]
    second = http.post("/v1/chat/completions", json=chat("Can I renew?")).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 32 <= cached < second["prompt_tokens"] and cached % 16 == 0


def test_streamed_chat_usage_counts_the_cached_prompt_tokens(http):
    http.post("/v1/chat/completions", json=chat("Where is the reading room?"))
    usage = streamed_usage(http, "/v1/chat/completions", chat("Are there fines?"))
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32


def test_completion_usage_counts_the_cached_prompt_tokens_streamed_or_not(http):
    prompt = SYSTEM + " Question: how many books may I borrow?"
    first = http.post("/v1/completions", json=completion(prompt)).json()["usage"]
    again = http.post("/v1/completions", json=completion(prompt)).json()["usage"]
    streamed = streamed_usage(http, "/v1/completions", completion(prompt))
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] >= 32
    assert streamed["prompt_tokens_details"] == again["prompt_tokens_details"]


def test_a_request_may_ask_for_its_prefix_to_be_retained(http, server):
    body = completion(SYSTEM + " Retain me.", cache={"ttl": 300})
    assert http.post("/v1/completions", json=body).status_code == 200
    server.wait_until_idle()
    assert server.engine.kv_manager.pool.num_retained_blocks >= 2


@pytest.mark.parametrize("cache", [{"ttl": -1}, {"ttl": 0}, {"ttl": "soon"}, "300"])
def test_a_bad_cache_field_is_a_400_naming_it(http, cache):
    for path, body in (("/v1/completions", completion("Hi")), ("/v1/chat/completions", chat("Hi"))):
        response = http.post(path, json={**body, "cache": cache})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "cache"


def test_a_restarted_server_serves_the_first_prefix_from_disk(start_server, tmp_path):
    engine_kwargs = {"kv_offload_dir": str(tmp_path)}
    with start_server(engine_kwargs) as live, live.http() as client:
        client.post("/v1/chat/completions", json=chat("When do you open?"))
    # The server's shutdown wrote the cached blocks to the directory.
    with start_server(engine_kwargs) as live, live.http() as client:
        usage = client.post("/v1/chat/completions", json=chat("Can I renew?")).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32
        assert live.metric("tokenmill_prefix_cache_disk_hits_total") >= 32
        assert live.metric("tokenmill_kv_disk_tier_hits_total") >= 2
        assert live.metric("tokenmill_kv_disk_tier_bytes_read_total") > 0
        assert live.metric("tokenmill_kv_disk_tier_writes_total") == 0
