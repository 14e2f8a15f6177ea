"""`tokenmill bench serve` against a real `tokenmill serve`, and the pieces it is built from."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tokenmill.bench.local_server import free_port
from tokenmill.bench.serve import (
    RequestTrace,
    ServeConfig,
    arrival_offsets_s,
    parse_goodput,
    parse_request_rate,
    requests_meeting,
    run_serve,
)
from tokenmill.bench.structured import schema_variants
from tokenmill.bench.workloads import BenchRequest

SMALL_POOL = ("--kv-cache-memory", "32MiB")


@pytest.fixture(scope="module")
def tokenmill_server() -> Iterator[str]:
    """`tokenmill serve` as a user starts it, on a free port; its base URL once healthy."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *SMALL_POOL],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, "tokenmill serve exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "tokenmill serve did not come up"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_cli_streams_the_workload_and_writes_json(
    tokenmill_cli, tokenmill_server, tiny_workload, tiny_requests, tmp_path
):
    out = tmp_path / "serve.json"
    result = tokenmill_cli(
        *("bench", "serve", "--base-url", tokenmill_server, "--workload", str(tiny_workload)),
        *("--request-rate", "20", "--max-concurrency", "2", "--json", str(out)),
        *("--goodput", "ttft_ms=60000,tpot_ms=60000"),
    )
    assert result.returncode == 0, result.stderr
    assert "ITL mean / p50 / p90 / p99" in result.stdout
    payload = json.loads(out.read_text())
    assert (payload["completed"], payload["failed"]) == (len(tiny_requests), 0)
    # greedy with ignore_eos: every request streams exactly the tokens it asked for
    assert payload["output_tokens"] == sum(r["max_tokens"] for r in tiny_requests)
    assert payload["model"] == "smollm2-135m-instruct"
    assert payload["goodput"] == pytest.approx(payload["request_throughput"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < payload[name]["p50"] <= payload[name]["p99"]
    assert payload["e2el_ms"]["max"] >= payload["ttft_ms"]["max"]


def test_all_at_once_with_a_base_url_ending_in_v1(tokenmill_server):
    requests = [BenchRequest([600, 700, 800], None, 3), BenchRequest(None, "Hello", 2)]
    result = run_serve(ServeConfig(f"{tokenmill_server}/v1/"), requests, use_tqdm=False)
    assert result.request_rate is None
    assert (result.completed, result.output_tokens, result.prompt_tokens) == (2, 5, 4)


def test_each_request_can_be_held_to_its_own_json_schema(tokenmill_server):
    requests = [BenchRequest([600, 700, 800], None, 4), BenchRequest([900, 1000], None, 4)]
    config = ServeConfig(tokenmill_server, json_schemas=2, seed=11)
    result = run_serve(config, requests, use_tqdm=False)
    assert (result.completed, result.failed, result.json_schemas) == (2, 0, 2)
    assert "2 distinct" in result.table()


def test_schema_variants_differ_in_their_field_names():
    first, second = schema_variants(2, seed=3)
    assert set(first["properties"]).isdisjoint(second["properties"])
    assert first["required"] == list(first["properties"])
    assert schema_variants(1, seed=4)[0] != first


def test_server_refusing_the_request_is_a_value_error_with_its_message(tokenmill_server):
    config = ServeConfig(tokenmill_server, model="no-such-model")
    with pytest.raises(ValueError, match="HTTP 404"):
        run_serve(config, [BenchRequest([600], None, 2)], use_tqdm=False)


def test_unreachable_server_is_a_one_line_cli_error(tokenmill_cli):
    result = tokenmill_cli(
        "bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--workload", "single"
    )
    assert result.returncode == 2
    assert "could not list models" in result.stderr and "Traceback" not in result.stderr


def test_poisson_arrivals_are_seeded_with_the_requested_mean_gap():
    offsets = arrival_offsets_s(4000, request_rate=8.0, seed=3)
    assert offsets == arrival_offsets_s(4000, request_rate=8.0, seed=3)
    assert offsets != arrival_offsets_s(4000, request_rate=8.0, seed=4)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0 and statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.1)
    assert arrival_offsets_s(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_max_concurrency_below_one_is_refused():
    with pytest.raises(ValueError, match="max_concurrency"):
        ServeConfig("http://127.0.0.1:1", max_concurrency=0)


def test_request_rate_parsing():
    assert parse_request_rate("inf") == math.inf and parse_request_rate("2.5") == 2.5
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ValueError, match="request_rate"):
            parse_request_rate(bad)


def test_goodput_parsing_names_the_bad_field():
    assert parse_goodput("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    bad_specs = [
        ("ttft=5", "ttft_ms, tpot_ms, e2el_ms"),
        ("tpot_ms=x", "tpot_ms"),
        ("e2el_ms=0", "e2el_ms"),
        ("", "at least one"),
    ]
    for bad, field in bad_specs:
        with pytest.raises(ValueError, match=field):
            parse_goodput(bad)


def test_a_request_meets_goodput_only_within_every_objective():
    trace = RequestTrace(output_tokens=11, ttft_s=0.2, e2e_s=1.2)  # TPOT 100 ms
    assert trace.meets({"ttft_ms": 250, "tpot_ms": 100})
    assert not trace.meets({"ttft_ms": 250, "tpot_ms": 99})
    assert not trace.meets({"e2el_ms": 1000})


def test_goodput_counts_completed_requests_within_every_objective():
    slos = {"ttft_ms": 500, "tpot_ms": 50}
    traces = [
        RequestTrace(output_tokens=5, ttft_s=0.4, e2e_s=0.6),  # TPOT 50 ms: met
        RequestTrace(output_tokens=5, ttft_s=0.6, e2e_s=0.8),  # TTFT too late
        RequestTrace(output_tokens=5, ttft_s=0.1, e2e_s=0.9),  # TPOT 200 ms
        RequestTrace(output_tokens=1, ttft_s=0.2, e2e_s=0.2),  # one token: no TPOT to miss
        RequestTrace(error="HTTP 503: busy"),  # failed: meets nothing
    ]
    assert requests_meeting(traces, slos) == 2
    assert requests_meeting(traces, {"e2el_ms": 850}) == 3


def test_prefix_hit_rate_counts_the_prompt_tokens_the_server_reports_cached(tokenmill_server):
    shared = list(range(600, 664))  # four blocks; the warm-up request caches them
    requests = [BenchRequest(shared, None, 2), BenchRequest(shared, None, 2)]
    config = ServeConfig(tokenmill_server, max_concurrency=1)
    result = run_serve(config, requests, use_tqdm=False)
    assert result.prefix_hit_rate is not None and result.prefix_hit_rate >= 0.5
