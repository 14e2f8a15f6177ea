"""`tokenmill serve --replicas 2`: the same OpenAI API as one engine, spread over two Ray Serve
replicas with prefix-aware routing; a replica's death is its clients' error, not a hang."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray

from tokenmill.cluster.app import APP_NAME
from tokenmill.cluster.board import NAMESPACE, board_name
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling.params import SamplingParams

MODEL_NAME = "smollm2-135m-instruct"  # the fixture's served name
PREFIX_TOKENS = 1000


def finished_by_replica(cluster) -> dict[str, float]:
    counts: dict[str, float] = {}
    for labels, value in cluster.samples("tokenmill_request_success_total"):
        if "replica" in labels:
            counts[labels["replica"]] = counts.get(labels["replica"], 0) + value
    return counts


def test_openai_client_streams_from_both_replicas(cluster, long_text: str):
    client = cluster.openai()
    before = finished_by_replica(cluster)
    for start in (0, 2000):  # two unrelated prompts: a new prefix goes to the emptier replica
        stream = client.completions.create(
            model=MODEL_NAME, prompt=long_text[start : start + 600], max_tokens=4, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    deadline = time.monotonic() + 10
    while True:  # the replicas post their series every half second
        after = finished_by_replica(cluster)
        served = [r for r in after if after[r] > before.get(r, 0)]
        if len(served) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert sorted(served) == ["0", "1"]


def test_greedy_output_equals_single_process_tokenmill(cluster, smollm):
    prompt = "The capital of France is"
    answer = cluster.openai().completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0
    )
    engine = LLMEngine(EngineArgs(model=str(smollm.path), kv_cache_memory="32MiB"), loaded=smollm)
    engine.add_request("local", prompt, SamplingParams(max_tokens=12, temperature=0))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None
    assert answer.choices[0].text == final.outputs[0].text


def test_requests_sharing_a_long_prefix_hit_one_replicas_cache(cluster, smollm, long_text):
    tokenizer = smollm.tokenizer
    prefix = tokenizer.decode(tokenizer.encode(long_text[4000:])[:PREFIX_TOKENS])

    def ask(i: int) -> int:
        body = {"prompt": f"{prefix}\n\nQuestion {i}: what is this about?", "max_tokens": 1}
        response = cluster.http().post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached = [ask(0)]  # the first fills one replica's cache; the rest arrive together
    with ThreadPoolExecutor(7) as pool:
        cached += list(pool.map(ask, range(1, 8)))
    hits = sum(1 for c in cached if c >= PREFIX_TOKENS - 64)
    assert hits >= 7, cached


def test_api_key_is_required_as_on_one_engine(cluster):
    response = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_bad_request_is_a_400_naming_the_field(cluster):
    response = cluster.http().post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_a_constrained_request_is_checked_at_the_ingress_and_held_on_the_replica(cluster):
    with cluster.http() as http:
        bad = {"prompt": "Hi", "max_tokens": 2, "response_format": {"type": "json_schema"}}
        refused = http.post("/v1/completions", json=bad)
        body = {
            "prompt": "Is the sky blue? Answer:",
            "max_tokens": 4,
            "structured_outputs": {"choice": ["yes", "no"]},
        }
        answered = http.post("/v1/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["text"] in ("yes", "no")


def test_client_disconnect_aborts_the_request_on_its_replica(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with cluster.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 20
    while True:
        aborted = sum(
            v
            for labels, v in cluster.samples("tokenmill_request_success_total")
            if labels == {"finished_reason": "abort"}
        )
        (running,) = [
            v for labels, v in cluster.samples("tokenmill_num_requests_running") if not labels
        ]
        if aborted >= 1 and running == 0:
            return
        assert time.monotonic() < deadline, (aborted, running)
        time.sleep(0.25)


def test_metrics_label_every_replica_and_total_them(cluster):
    samples = cluster.samples("tokenmill_prompt_tokens_total")
    by_replica = {labels["replica"]: v for labels, v in samples if "replica" in labels}
    (total,) = [v for labels, v in samples if not labels]
    assert sorted(by_replica) == ["0", "1"]
    assert total == sum(by_replica.values())
    summary = cluster.http().get("/v1/metrics").json()
    assert summary["replicas_up"] == 2 and sorted(summary["replicas"]) == ["0", "1"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core per replica")
def test_each_replica_is_pinned_to_a_core_of_its_own(cluster):
    replicas = cluster.http().get("/v1/metrics").json()["replicas"]
    cores = [replicas[rank]["cores"] for rank in ("0", "1")]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1]


def test_killed_replica_errors_its_stream_and_the_deployment_serves_again(cluster):
    client = cluster.openai()
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Tell me a very long story.",
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    board = ray.get_actor(board_name(APP_NAME), namespace=NAMESPACE)
    deadline = time.monotonic() + 10
    while True:
        busy = [
            r
            for r in ray.get(board.reports.remote()).values()
            if r.fresh and r.summary["num_requests_running"]
        ]
        if busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(busy) == 1
    os.kill(busy[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in chunks:
            pass
    assert time.monotonic() - killed_at < 60
    deadline = time.monotonic() + 180
    while True:  # Serve replaces the dead replica: two running replicas, none of them the dead
        fresh = [r for r in ray.get(board.reports.remote()).values() if r.fresh and r.running]
        if len(fresh) == 2 and busy[0].pid not in {r.pid for r in fresh}:
            break
        assert time.monotonic() < deadline, "the dead replica was never replaced"
        time.sleep(0.5)
    cluster.wait_healthy()
    answer = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    assert answer.choices[0].text
