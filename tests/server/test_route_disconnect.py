"""A cascade whose client leaves: the small model's pass (which runs before the response starts)
and the large model's are aborted, and neither engine keeps a KV block."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import pytest

from tokenmill.gateway.routing import RouteSpec
from tokenmill.loader.model_loader import LoadedModel

SMOLLM, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
ROUTES = {"auto": RouteSpec("auto", "cascade", SMOLLM, GEMMA, threshold=0.0)}  # always escalates


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, gemma: LoadedModel, serve_engines) -> Iterator:
    engines = {
        SMOLLM: serve_engines.engine(smollm, kv_cache_memory="64MiB"),
        GEMMA: serve_engines.engine(gemma, kv_cache_memory="64MiB"),
    }
    with serve_engines(engines, routes=ROUTES) as live:
        yield live


def body(max_tokens: int) -> dict:
    return {
        "model": "auto",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def model_metric(server, name: str, model: str, **labels: str) -> float:
    return server.metric_with_labels(name, model=model, **labels)


def wait_for(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def wait_until_both_idle(server) -> None:
    def idle() -> bool:
        return not any(
            model_metric(server, name, model)
            for model in (SMOLLM, GEMMA)
            for name in (
                "tokenmill_num_requests_running",
                "tokenmill_num_requests_waiting",
                "tokenmill_kv_cache_blocks_in_use",
            )
        )

    wait_for(idle)


def aborted(server, model: str) -> float:
    return model_metric(server, "tokenmill_request_success_total", model, finished_reason="abort")


def test_a_client_leaving_during_the_small_pass_aborts_it_and_never_runs_the_large(server):
    small_aborts, large_aborts = aborted(server, SMOLLM), aborted(server, GEMMA)
    large_prompts = model_metric(server, "tokenmill_prompt_tokens_total", GEMMA)
    escalations = server.metric_with_labels("tokenmill_route_escalations_total", route="auto")
    address = urlparse(server.url)
    payload = json.dumps(body(max_tokens=512)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(head.encode() + payload)
        wait_for(lambda: model_metric(server, "tokenmill_num_requests_running", SMOLLM) == 1)
    wait_until_both_idle(server)
    assert aborted(server, SMOLLM) == small_aborts + 1
    assert aborted(server, GEMMA) == large_aborts
    assert model_metric(server, "tokenmill_prompt_tokens_total", GEMMA) == large_prompts
    assert server.metric_with_labels("tokenmill_route_escalations_total", route="auto") == (
        escalations
    )


def test_a_client_leaving_the_escalated_stream_aborts_the_large_pass(server):
    large_aborts = aborted(server, GEMMA)
    request = body(max_tokens=128)  # the large pass outlasts the client by far
    with server.http() as client, client.stream("POST", "/v1/chat/completions", json=request) as r:
        assert r.headers["x-tokenmill-model"] == GEMMA
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        next(events)  # the opening chunk: the assistant's role
        assert json.loads(next(events)[6:])["choices"][0]["delta"]["content"]
    wait_until_both_idle(server)
    assert aborted(server, GEMMA) == large_aborts + 1
