"""Several models in one server: each request answered by the model it names, and routes that
pick one of two models and say which answered."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tokenmill.gateway.calibration import RESULTS, needs_large, read_records
from tokenmill.gateway.classifier import train_classifier
from tokenmill.gateway.embedding import packaged_embedder
from tokenmill.gateway.routing import RouteSpec
from tokenmill.loader.model_loader import LoadedModel

SMOLLM, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
ROUTES = {
    # a threshold no mean logprob reaches: always escalates
    "auto": RouteSpec("auto", "cascade", SMOLLM, GEMMA, threshold=0.0),
    # a threshold every answer clears: the small model always answers
    "cheap": RouteSpec("cheap", "cascade", SMOLLM, GEMMA, threshold=-1e9),
}


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, gemma: LoadedModel, serve_engines, tmp_path_factory) -> Iterator:
    engines = {
        SMOLLM: serve_engines.engine(smollm, kv_cache_memory="64MiB"),
        GEMMA: serve_engines.engine(gemma, kv_cache_memory="64MiB"),
    }
    records = read_records(RESULTS)
    classifier = tmp_path_factory.mktemp("router") / "router.json"
    train_classifier(
        [r["question"] for r in records], [needs_large(r) for r in records], packaged_embedder()
    ).save(classifier)
    routes = {
        **ROUTES,
        # a probability every prompt reaches: always the large model
        "picker": RouteSpec("picker", "classifier", SMOLLM, GEMMA, 0.0, classifier=str(classifier)),
        "coin": RouteSpec("coin", "random", SMOLLM, GEMMA, threshold=0.0),  # never large
    }
    with serve_engines(engines, routes=routes) as live:
        yield live


def chat(server, model: str | None, **fields):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}
    body.update(temperature=0, **fields)
    if model is not None:
        body["model"] = model
    with server.http() as client:
        return client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("model", [SMOLLM, GEMMA])
def test_each_model_answers_by_its_name(server, model: str):
    response = chat(server, model)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    assert response.headers["x-tokenmill-model"] == model
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_request_naming_no_model_goes_to_the_first(server):
    assert chat(server, None).json()["model"] == SMOLLM


def test_an_unknown_model_is_a_404_model_not_found(server):
    response = chat(server, "gpt-4o")
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert SMOLLM in error["message"] and GEMMA in error["message"]


def test_models_lists_every_model_and_route(server):
    with server.http() as client:
        ids = [card["id"] for card in client.get("/v1/models").json()["data"]]
    assert ids == [SMOLLM, GEMMA, "auto", "cheap", "picker", "coin"]


def test_each_model_tokenizes_with_its_own_tokenizer(server):
    with server.http() as client:
        counts = {
            m: client.post("/tokenize", json={"model": m, "prompt": "tokenmill"}).json()["tokens"]
            for m in (SMOLLM, GEMMA)
        }
    assert counts[SMOLLM] != counts[GEMMA]


def test_metrics_carry_a_model_label(server):
    chat(server, GEMMA)
    with server.http() as client:
        text = client.get("/metrics").text
    for model in (SMOLLM, GEMMA):
        assert f'tokenmill_generation_tokens_total{{model="{model}"}}' in text


def test_a_cascade_under_its_threshold_escalates_and_names_the_large_model(server):
    before = server.metric_with_labels("tokenmill_route_escalations_total", route="auto")
    response = chat(server, "auto")
    assert response.status_code == 200, response.text
    assert response.json()["model"] == GEMMA
    assert response.headers["x-tokenmill-model"] == GEMMA
    assert server.metric_with_labels("tokenmill_route_escalations_total", route="auto") == (
        before + 1
    )


def test_a_confident_cascade_answer_stays_with_the_small_model(server):
    response = chat(server, "cheap")
    assert response.json()["model"] == SMOLLM
    assert response.json()["choices"][0]["message"]["content"]
    assert (
        server.metric_with_labels("tokenmill_route_requests_total", route="cheap", model=SMOLLM)
        >= 1
    )


def test_a_routed_stream_names_the_model_that_answered_in_every_chunk(server):
    body = {
        "model": "auto",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with server.http() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["x-tokenmill-model"] == GEMMA
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert {c["model"] for c in chunks} == {GEMMA}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


@pytest.mark.parametrize(("route", "model"), [("picker", GEMMA), ("coin", SMOLLM)])
def test_classifier_and_random_routes_name_the_model_they_picked(server, route, model):
    response = chat(server, route)
    assert (response.json()["model"], response.headers["x-tokenmill-model"]) == (model, model)
    assert server.metric_with_labels("tokenmill_route_requests_total", route=route, model=model)
