"""Engine metrics fed by a real engine run: one observation per event they claim to count."""

from __future__ import annotations

from prometheus_client import generate_latest

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.metrics import EngineMetrics, EngineStats
from tokenmill.sampling.params import SamplingParams


def sample(metrics: EngineMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_a_finished_request_is_observed_once_per_latency_and_token(smollm):
    engine = LLMEngine(EngineArgs(model=str(smollm.path), kv_cache_memory="64MiB"), loaded=smollm)
    stats = [EngineStats.of(engine)]
    metrics = EngineMetrics(lambda: stats[-1])
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
    engine.add_request("r", "The capital of France is", params)
    metrics.request_added("r", arrival=0.0, num_sequences=2)
    running = []
    num_outputs = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            metrics.request_output(output)
            num_outputs += 1
        running.append(EngineStats.of(engine))
    stats.append(EngineStats.of(engine))

    # Every output carries a token: the second sample, forking the computed prompt, runs a
    # step behind the first, so 7 outputs bring its 12 tokens.
    assert num_outputs == 7
    assert sample(metrics, "tokenmill_time_to_first_token_seconds_count") == 1
    assert sample(metrics, "tokenmill_inter_token_latency_seconds_count") == num_outputs - 1
    assert sample(metrics, "tokenmill_time_per_output_token_seconds_count") == 1
    assert sample(metrics, "tokenmill_e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "tokenmill_generation_tokens_total") == 12
    assert sample(metrics, "tokenmill_prompt_tokens_total") == len(
        engine.tokenizer.encode("The capital of France is")
    )
    assert sample(metrics, "tokenmill_request_success_total", {"finished_reason": "length"}) == 2
    assert any(s.num_running == 2 and s.kv_blocks_in_use > 0 for s in running)
    assert sample(metrics, "tokenmill_num_requests_running") == 0
    assert sample(metrics, "tokenmill_kv_cache_blocks_in_use") == 0
    assert b"tokenmill_prefix_cache_hit_rate" in generate_latest(metrics.registry)


def test_an_aborted_request_counts_each_of_its_sequences():
    metrics = EngineMetrics(EngineStats)
    metrics.request_added("r", arrival=0.0, num_sequences=3)
    metrics.request_ended("r", "abort")
    metrics.request_ended("r", "abort")  # a second end of the same request is not counted
    assert sample(metrics, "tokenmill_request_success_total", {"finished_reason": "abort"}) == 3


def test_the_summary_reports_the_engine_state_of_the_last_step():
    stats = EngineStats(
        num_running=2,
        num_waiting=3,
        kv_blocks_total=40,
        kv_blocks_in_use=10,
        num_preemptions=1,
        prefix_cache_queried_tokens=200,
        prefix_cache_hit_tokens=50,
        spec_draft_tokens=8,
        spec_accepted_tokens=6,
        spec_verify_steps=2,
    )
    summary = EngineMetrics(lambda: stats).summary()
    assert summary["num_requests_running"] == 2 and summary["num_requests_waiting"] == 3
    assert summary["kv_cache_blocks_in_use"] == 10 and summary["kv_cache_blocks_total"] == 40
    assert summary["kv_cache_usage"] == 0.25
    assert summary["num_preemptions"] == 1
    assert summary["prefix_cache_hit_rate"] == 0.25
    assert summary["spec_decode_draft_tokens"] == 8
    assert summary["spec_decode_accepted_tokens"] == 6
    assert summary["spec_decode_acceptance_rate"] == 0.75
    assert summary["spec_decode_verify_steps"] == 2
    assert summary["spec_decode_accepted_tokens_per_step"] == 3.0
    assert summary["spec_decode_mean_accepted_length"] == 4.0


def test_the_summary_rates_are_null_before_anything_was_looked_up_or_drafted():
    summary = EngineMetrics(EngineStats).summary()
    assert summary["prefix_cache_hit_rate"] is None
    assert summary["spec_decode_acceptance_rate"] is None
    assert summary["spec_decode_mean_accepted_length"] is None
    assert summary["kv_cache_usage"] == 0.0
