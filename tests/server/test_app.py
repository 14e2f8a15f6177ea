"""The server around the endpoints: small routes, OpenAI-style errors, auth, back-pressure,
disconnects, a failing request, /metrics, and SIGTERM on a real `tokenmill serve` process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with server.http() as client:
        yield client


def completion(prompt: str = "Hello", **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    return error["message"]


# --- small routes ---------------------------------------------------------------------------


def test_health_and_models(http):
    assert http.get("/health").status_code == 200
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0


def test_tokenize_and_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tokens["count"]  # the chat template's markers


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(http):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["count"] == 1


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(max_tokens="4"), "max_tokens"),
        (completion(prompt=5), "prompt"),
        (completion(max_tokens=0), "max_tokens"),
        (completion(max_tokens=-1, echo=True), "max_tokens"),
        (completion(temperature=-0.5), "temperature"),
        (completion(top_p=0), "top_p"),
        (completion(top_p=1.5), "top_p"),
        (completion(n=1000), "n"),
        (completion(logprobs=50), "logprobs"),
        (completion(prompt=[]), "prompt"),
        (completion(prompt=[[1, 2], [10**9]]), "prompt"),
        ({"model": MODEL}, "prompt"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(http, body, param):
    assert_openai_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "top_logprobs": 2,
            },
            "top_logprobs",
        ),
    ],
)
def test_bad_chat_requests_get_400(http, body, param):
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json_gets_400(http):
    response = http.post(
        "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in assert_openai_error(response, 400, None)


def test_prompt_longer_than_the_context_names_both_numbers(http):
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    too_long = [100] * (limit + 10)
    message = assert_openai_error(
        http.post("/v1/completions", json=completion(prompt=too_long)), 400, "prompt"
    )
    assert str(limit) in message and str(limit + 10) in message
    message = assert_openai_error(
        http.post("/v1/completions", json=completion(prompt=[100] * 10, max_tokens=limit)),
        400,
        "max_tokens",
    )
    assert str(limit) in message and str(limit + 10) in message


def test_unknown_model_gets_404(http):
    response = http.post("/v1/completions", json=completion(model="gpt-5"))
    assert_openai_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"


def test_the_openai_client_raises_its_typed_errors(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


# --- disconnects ----------------------------------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_every_block(server, http):
    aborted_before = labelled(http, "tokenmill_request_success_total", "abort")
    body = completion(stream=True, **LONG)
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.metric("tokenmill_num_requests_running") == 1
        assert server.metric("tokenmill_kv_cache_blocks_in_use") > 0
    server.wait_until_idle()
    assert labelled(http, "tokenmill_request_success_total", "abort") == aborted_before + 1


def test_disconnect_of_a_non_streaming_request_aborts_it(server, http):
    aborted_before = labelled(http, "tokenmill_request_success_total", "abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=completion(**LONG), timeout=1.0)
    server.wait_until_idle()
    assert labelled(http, "tokenmill_request_success_total", "abort") == aborted_before + 1


# --- metrics --------------------------------------------------------------------------------


def test_metrics_list_every_documented_family(http):
    http.post("/v1/completions", json=completion())
    text = http.get("/metrics").text
    for name in (
        'tokenmill_request_success_total{finished_reason="length"}',
        "tokenmill_time_to_first_token_seconds_bucket",
        "tokenmill_time_per_output_token_seconds_bucket",
        "tokenmill_inter_token_latency_seconds_bucket",
        "tokenmill_e2e_request_latency_seconds_bucket",
        "tokenmill_prompt_tokens_total",
        "tokenmill_generation_tokens_total",
        "tokenmill_num_requests_running",
        "tokenmill_num_requests_waiting",
        "tokenmill_kv_cache_usage_ratio",
        "tokenmill_kv_cache_blocks_in_use",
        "tokenmill_prefix_cache_queries_total",
        "tokenmill_prefix_cache_hits_total",
        "tokenmill_prefix_cache_hit_rate",
        "tokenmill_num_preemptions_total",
    ):
        assert name in text, name


def labelled(http: httpx.Client, name: str, reason: str) -> float:
    prefix = f'{name}{{finished_reason="{reason}"}} '
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[1]) if lines else 0.0


# --- servers of their own -------------------------------------------------------------------


def test_api_key_guards_everything_but_health(start_server):
    with start_server(api_key="secret") as live:
        assert httpx.get(f"{live.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            response = httpx.post(f"{live.url}/v1/completions", json=completion(), headers=headers)
            assert_openai_error(response, 401, None)
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{live.url}/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            live.openai(api_key="wrong").models.list()
        reply = live.openai(api_key="secret").completions.create(model=MODEL, prompt="Hi")
        assert reply.choices[0].text


def test_requests_beyond_max_waiting_get_503_with_retry_after(start_server):
    with start_server({"max_num_seqs": 1}, max_waiting_requests=1) as live, live.http() as http:
        body = completion(stream=True, **LONG)
        with http.stream("POST", "/v1/completions", json=body) as running:
            next(line for line in running.iter_lines() if line.startswith("data:"))
            with http.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200
                refused = http.post("/v1/completions", json=completion())
                assert_openai_error(refused, 503, None)
                assert refused.headers["retry-after"] == "1"
        live.wait_until_idle()
        assert http.post("/v1/completions", json=completion()).status_code == 200


def test_a_failing_request_gets_500_and_the_server_keeps_serving(start_server):
    with start_server() as live, live.http() as http:
        runner = live.engine.runner
        execute = runner.execute

        def fail_once(scheduled):
            runner.execute = execute
            raise RuntimeError("injected failure")

        runner.execute = fail_once
        failed = http.post("/v1/completions", json=completion())
        assert "injected failure" in assert_openai_error(failed, 500, None)
        assert failed.json()["error"]["type"] == "server_error"
        assert http.post("/v1/completions", json=completion()).status_code == 200
        runner.execute = fail_once
        with http.stream("POST", "/v1/completions", json=completion(stream=True)) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data:")]
        assert "injected failure" in json.loads(events[-2][5:])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        live.wait_until_idle()
        assert http.post("/v1/completions", json=completion()).status_code == 200


def test_sigterm_finishes_the_stream_in_flight_and_exits_0(smollm_path, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(smollm_path)]
    command += ["--served-model-name", MODEL, "--port", str(port), "--kv-cache-memory", "64MiB"]
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = completion(stream=True, max_tokens=24, temperature=0, ignore_eos=True)
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        usage = json.loads(rest[-2][5:])["usage"]
        assert usage["completion_tokens"] == 24 and rest[-1] == "data: [DONE]"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
