"""`tokenmill bench throughput` end to end, and what run_throughput counts."""

from __future__ import annotations

import json

from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workloads import BenchRequest
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine


def test_cli_prints_the_table_and_writes_json(
    tokenmill_cli, tiny_workload, tiny_requests, tmp_path
):
    out = tmp_path / "result.json"
    result = tokenmill_cli(
        *("bench", "throughput", "--workload", str(tiny_workload), "--json", str(out)),
        *("--kv-cache-memory", "32MiB"),
    )
    assert result.returncode == 0, result.stderr
    assert "output tokens/s" in result.stdout and "TTFT mean / p50 / p99" in result.stdout
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "throughput"
    assert payload["num_requests"] == len(tiny_requests)
    assert payload["output_tokens"] == sum(r["max_tokens"] for r in tiny_requests)
    assert payload["kv_cache_bytes"] > 0 and payload["peak_rss_mib"] > 0
    assert set(payload["ttft_ms"]) == {"mean", "p50", "p90", "p99", "max"}
    assert payload["engine_args"]["kv_cache"] == "paged"


def test_a_second_run_on_one_engine_reports_only_its_own_cache_hits(smollm):
    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), smollm)
    prompt = list(range(1000, 1040))  # two full blocks and a partial one
    requests = [BenchRequest(prompt, None, 2)]
    first = run_throughput(engine, requests, "first", use_tqdm=False)
    second = run_throughput(engine, requests, "second", use_tqdm=False)
    assert first.prefix_cache_hit_rate == 0
    assert second.prefix_cache_hit_rate == 32 / 40


def test_step_observer_sees_every_step_and_the_finished_outputs(smollm):
    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), smollm)
    seen_steps, finished = [], []

    def observe(observed: LLMEngine, outputs) -> None:
        seen_steps.append(observed is engine)
        finished.extend(out.request_id for out in outputs if out.finished)

    run_throughput(engine, [BenchRequest([500, 600, 700], None, 4)], "x", False, observe)
    assert seen_steps == [True] * 4  # one prefill step, then three decode steps
    assert len(finished) == 1


def test_sampled_runs_repeat_with_a_seed_and_differ_from_greedy(smollm):
    """`--temperature` and `--seed`: request i draws with seed + i, so a seeded sampled run is
    reproducible; the default stays greedy."""
    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), smollm)
    requests = [BenchRequest([500, 600, 700], None, 12), BenchRequest([800, 900], None, 12)]
    runs = {}
    for name, temperature, seed in (("greedy", 0.0, None), ("a", 1.0, 5), ("b", 1.0, 5)):
        tokens = []

        def keep(_: LLMEngine, outputs, tokens=tokens) -> None:
            tokens.extend(out.outputs[0].token_ids for out in outputs if out.finished)

        run_throughput(engine, requests, name, False, keep, temperature=temperature, seed=seed)
        runs[name] = sorted(tokens)
    assert runs["a"] == runs["b"] != runs["greedy"]


def test_a_sessions_next_turn_is_sent_after_its_last_and_hits_its_prefix(smollm):
    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), smollm)
    first = list(range(1000, 1040))
    requests = [BenchRequest(first, None, 2), BenchRequest([*first, 7, 8], None, 2, after=0)]
    seen: list[str] = []

    def observe(_: LLMEngine, outputs) -> None:
        seen.extend(out.request_id for out in outputs if out.finished)

    result = run_throughput(engine, requests, "turns", use_tqdm=False, on_step=observe)
    assert [request_id.rsplit("-", 1)[1] for request_id in seen] == ["0", "1"]
    assert result.prefix_cache_hit_rate == 32 / 82  # the second turn's two full blocks


def test_a_json_schema_run_holds_outputs_to_it_and_reports_the_mask_cost(smollm):
    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), smollm)
    done = []

    def keep(_: LLMEngine, outputs) -> None:
        done.extend(out.outputs[0] for out in outputs if out.finished)

    requests = [BenchRequest([500, 600, 700], None, 96), BenchRequest([800, 900], None, 96)]
    result = run_throughput(engine, requests, "x", False, keep, json_schema="five_fields")
    cost = result.structured
    assert cost is not None and cost.num_masked_steps > 0 and cost.mask_ms_per_step > 0
    assert cost.fill_ms_per_step > 0
    assert cost.compile.compile_cold_s > cost.compile.compile_cached_s
    assert "mask per step" in result.table()
    for completion in done:  # complete JSON, or cut off by max_tokens inside it
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert set(json.loads(completion.text)) == {"name", "age", "email", "member", "tags"}
