"""The seeds' endpoints on a live server: POST /v1/generate (plain and streamed, its errors,
the API key) and GET /v1/metrics, a JSON summary of the counters behind /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with server.http() as client:
        yield client


def test_generate_returns_text_tokens_latency_and_rate(http):
    reply = http.post(
        "/v1/generate",
        json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {
        "text",
        "tokens_generated",
        "latency_ms",
        "tokens_per_second",
        "finish_reason",
    }
    assert "Paris" in body["text"] and body["tokens_generated"] <= 6
    assert body["latency_ms"] > 0
    assert body["tokens_per_second"] == pytest.approx(
        body["tokens_generated"] / (body["latency_ms"] / 1000), rel=1e-6
    )


def test_generate_defaults_are_the_seeds(http):
    body = http.post("/v1/generate", json={"prompt": "Once upon a time"}).json()
    # 100 tokens at temperature 1.0 unless the model ends first
    assert 0 < body["tokens_generated"] <= 100
    assert body["finish_reason"] in ("stop", "length")
    assert body["finish_reason"] == "stop" or body["tokens_generated"] == 100


def test_streamed_generation_sends_pieces_then_the_whole_result(http):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    plain = http.post("/v1/generate", json=body).json()
    with http.stream("POST", "/v1/generate", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data:")
        ]
    assert events[-1] == "[DONE]"
    *pieces, last = [json.loads(event) for event in events[:-1]]
    assert "".join(piece["text"] for piece in pieces) == plain["text"] == last["text"]
    assert last["tokens_generated"] == plain["tokens_generated"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "Hi", "max_tokens": "4"}, "max_tokens"),
        ({"prompt": "Hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "Hi", "max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_bad_generate_requests_are_400s_naming_the_field(http, body, param):
    response = http.post("/v1/generate", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_metrics_summary_counts_what_was_served(http):
    before = http.get("/v1/metrics").json()
    http.post("/v1/generate", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    after = http.get("/v1/metrics").json()
    assert after["total_requests"] == before["total_requests"] + 1
    assert after["total_generated_tokens"] - before["total_generated_tokens"] == 3
    assert after["total_tokens"] == after["total_prompt_tokens"] + after["total_generated_tokens"]
    assert after["average_latency_ms"] > 0 and after["average_tokens_per_second"] > 0
    assert after["average_batch_size"] >= 1
    for series in ("ttft_ms", "tpot_ms"):
        p50, p90, p99 = (after[series][f"p{q}"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99


def test_metrics_summary_carries_the_engine_state_behind_the_gauges(server, http):
    http.post("/v1/generate", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    server.wait_until_idle()
    summary = http.get("/v1/metrics").json()
    assert summary["num_requests_running"] == 0 and summary["num_requests_waiting"] == 0
    assert summary["kv_cache_blocks_total"] == server.engine.kv_manager.num_blocks
    assert summary["kv_cache_usage"] == server.metric("tokenmill_kv_cache_usage_ratio") == 0
    assert summary["prefix_cache_queried_tokens"] > 0
    assert summary["prefix_cache_hit_rate"] == pytest.approx(
        server.metric("tokenmill_prefix_cache_hit_rate")
    )
    assert summary["spec_decode_acceptance_rate"] is None  # no speculation on this server


def test_the_seeds_endpoints_need_the_api_key(start_server):
    with start_server(api_key="secret") as live:
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"{live.url}/v1/generate", json=body).status_code == 401
        assert httpx.get(f"{live.url}/v1/metrics").status_code == 401
        headers = {"Authorization": "Bearer secret"}
        assert httpx.post(f"{live.url}/v1/generate", json=body, headers=headers).status_code == 200
        assert httpx.get(f"{live.url}/v1/metrics", headers=headers).status_code == 200
