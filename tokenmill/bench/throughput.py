"""`tokenmill bench throughput`: run a workload offline and report tokens/s and latencies."""

from __future__ import annotations

import dataclasses
import itertools
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from tokenmill.bench.report import key_value_table
from tokenmill.bench.stats import Distribution
from tokenmill.bench.structured import StructuredCost, load_json_schema, measure_compile, snapshot
from tokenmill.bench.workloads import BenchRequest
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.scheduler import SchedulerStats
from tokenmill.sampling.params import SamplingParams

StepObserver = Callable[[LLMEngine, list[RequestOutput]], None]
_run_ids = itertools.count()


@dataclass
class ThroughputResult:
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    latency_ms: Distribution  # arrival to last token
    peak_rss_mib: float
    kv_cache_bytes: int
    max_concurrent_requests: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    prefix_cache_disk_hit_rate: float = 0.0  # prompt tokens the disk tier served, of those queried
    # Speculative decoding (all zero without it): accepted / drafted tokens, tokens per verify
    # step, and the time spent drafting and in the steps that verified.
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_draft_time_s: float = 0.0
    spec_verify_time_s: float = 0.0
    # With a JSON schema on every request: its compile times and the masks' cost per step.
    structured: StructuredCost | None = None

    def table(self) -> str:
        return key_value_table(
            [
                ("workload", self.workload),
                ("requests", f"{self.num_requests}"),
                ("prompt / output tokens", f"{self.prompt_tokens} / {self.output_tokens}"),
                ("elapsed", f"{self.elapsed_s:.2f} s"),
                ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
                ("total tokens/s", f"{self.total_tokens_per_s:.1f}"),
                ("TTFT mean / p50 / p99", self.ttft_ms.summary()),
                ("TPOT mean / p50 / p99", self.tpot_ms.summary()),
                ("latency mean / p50 / p99", self.latency_ms.summary()),
                ("peak RSS", f"{self.peak_rss_mib:.0f} MiB"),
                ("KV cache", f"{self.kv_cache_bytes / 2**20:.0f} MiB ({self.kv_cache_bytes:,} B)"),
                ("max concurrent requests", f"{self.max_concurrent_requests}"),
                ("preemptions", f"{self.num_preemptions}"),
                ("prefix-cache hit rate", f"{self.prefix_cache_hit_rate:.1%}"),
                ("  of which from disk", f"{self.prefix_cache_disk_hit_rate:.1%}"),
                *self._speculation_rows(),
                *(self.structured.rows() if self.structured is not None else []),
            ]
        )

    def _speculation_rows(self) -> list[tuple[str, str]]:
        if not self.spec_mean_accepted_length:
            return []
        times = f"{self.spec_draft_time_s:.2f} s / {self.spec_verify_time_s:.2f} s"
        return [
            ("spec acceptance rate", f"{self.spec_acceptance_rate:.1%}"),
            ("spec mean accepted length", f"{self.spec_mean_accepted_length:.2f} tokens"),
            ("spec draft / verify time", times),
        ]


def run_throughput(
    engine: LLMEngine,
    requests: list[BenchRequest],
    workload: str,
    use_tqdm: bool = True,
    on_step: StepObserver | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    json_schema: str | None = None,
) -> ThroughputResult:
    """All requests arrive at once (offline), with ignore_eos so lengths are fixed; greedy, or
    sampled at `temperature` (request i seeded with `seed` + i when a seed is given).

    `json_schema` (a built-in name or a file, bench/structured.py): every request's output is
    held to that schema, so a request ends early when its JSON is complete. The schema is
    compiled before the clock starts, its compile times reported apart.

    `on_step` sees the engine and the step's outputs after every step (the ablation reads KV
    occupancy and finish times there)."""
    before = dataclasses.replace(engine.scheduler.stats)  # the engine may have run before
    spec = None if json_schema is None else load_json_schema(json_schema)
    compile_times = None if spec is None else measure_compile(engine, spec)
    structured_before = snapshot(engine)
    run_id = next(_run_ids)
    start = time.monotonic()
    followers: dict[int, list[int]] = {}  # request index -> the requests sent once it finishes
    for index, item in enumerate(requests):
        if item.after is not None:
            followers.setdefault(item.after, []).append(index)

    def submit(index: int) -> None:
        params = SamplingParams(
            temperature=temperature,
            max_tokens=requests[index].max_tokens,
            ignore_eos=True,
            seed=None if seed is None else seed + index,
            structured_outputs=spec,
        )
        engine.add_request(f"bench-{run_id}-{index}", requests[index].prompt_input, params)

    for index, item in enumerate(requests):
        if item.after is None:
            submit(index)
    finished: list[RequestOutput] = []
    max_running = 0
    with tqdm(total=len(requests), desc=f"bench {workload}", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            max_running = max(max_running, len(engine.scheduler.running))
            if on_step is not None:
                on_step(engine, outputs)
            for output in outputs:
                if output.finished:
                    finished.append(output)
                    bar.update(1)
                    for follower in followers.get(int(output.request_id.rsplit("-", 1)[1]), ()):
                        submit(follower)
    elapsed = time.monotonic() - start
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finished)
    output_tokens = sum(len(out.outputs[0].token_ids) for out in finished)
    stats = engine.scheduler.stats
    cached = stats.num_prompt_tokens_cached - before.num_prompt_tokens_cached
    queried = stats.num_prompt_tokens_queried - before.num_prompt_tokens_queried
    return ThroughputResult(
        workload=workload,
        num_requests=len(finished),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        elapsed_s=elapsed,
        output_tokens_per_s=output_tokens / elapsed,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        ttft_ms=Distribution.of([ttft_s(out) * 1000 for out in finished]),
        tpot_ms=Distribution.of(
            [_tpot_s(out) * 1000 for out in finished if len(out.outputs[0].token_ids) > 1]
        ),
        latency_ms=Distribution.of([_latency_s(out) * 1000 for out in finished]),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        kv_cache_bytes=engine.kv_cache_bytes,
        max_concurrent_requests=max_running,
        num_preemptions=stats.num_preemptions - before.num_preemptions,
        prefix_cache_hit_rate=cached / max(queried, 1),
        prefix_cache_disk_hit_rate=(
            stats.num_prompt_tokens_from_disk - before.num_prompt_tokens_from_disk
        )
        / max(queried, 1),
        **_speculation_summary(before, stats),
        structured=None
        if json_schema is None or compile_times is None
        else StructuredCost.of(
            json_schema, compile_times, structured_before, snapshot(engine), elapsed
        ),
    )


def _speculation_summary(before: SchedulerStats, after: SchedulerStats) -> dict[str, float]:
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    steps = after.num_verify_steps - before.num_verify_steps
    return {
        "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
        "spec_mean_accepted_length": 1 + accepted / steps if steps else 0.0,
        "spec_draft_time_s": after.spec_draft_time_s - before.spec_draft_time_s,
        "spec_verify_time_s": after.spec_verify_time_s - before.spec_verify_time_s,
    }


def ttft_s(output: RequestOutput) -> float:
    assert output.metrics.first_token_time is not None
    return output.metrics.first_token_time - output.metrics.arrival_time


def _tpot_s(output: RequestOutput) -> float:
    metrics = output.metrics
    assert metrics.first_token_time is not None and metrics.finish_time is not None
    return (metrics.finish_time - metrics.first_token_time) / (len(output.outputs[0].token_ids) - 1)


def _latency_s(output: RequestOutput) -> float:
    assert output.metrics.finish_time is not None
    return output.metrics.finish_time - output.metrics.arrival_time
