"""`tokenmill bench throughput`: run a workload offline and report tokens/s and latencies."""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from tokenmill.bench.workloads import BenchRequest
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams


@dataclass
class Distribution:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(0.0, 0.0, 0.0)
        ordered = sorted(values)
        return cls(
            statistics.fmean(ordered),
            _percentile(ordered, 50),
            _percentile(ordered, 99),
        )


def _percentile(ordered: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    position = (len(ordered) - 1) * pct / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


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
    peak_rss_mib: float
    kv_cache_bytes: int
    max_concurrent_requests: int
    num_preemptions: int
    prefix_cache_hit_rate: float

    def table(self) -> str:
        rows = [
            ("workload", self.workload),
            ("requests", f"{self.num_requests}"),
            ("prompt / output tokens", f"{self.prompt_tokens} / {self.output_tokens}"),
            ("elapsed", f"{self.elapsed_s:.2f} s"),
            ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
            ("total tokens/s", f"{self.total_tokens_per_s:.1f}"),
            ("TTFT mean / p50 / p99", _ms(self.ttft_ms)),
            ("TPOT mean / p50 / p99", _ms(self.tpot_ms)),
            ("peak RSS", f"{self.peak_rss_mib:.0f} MiB"),
            ("KV cache", f"{self.kv_cache_bytes / 2**20:.0f} MiB"),
            ("max concurrent requests", f"{self.max_concurrent_requests}"),
            ("preemptions", f"{self.num_preemptions}"),
            ("prefix-cache hit rate", f"{self.prefix_cache_hit_rate:.1%}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _ms(dist: Distribution) -> str:
    return f"{dist.mean:.1f} / {dist.p50:.1f} / {dist.p99:.1f} ms"


def run_throughput(
    engine: LLMEngine, requests: list[BenchRequest], workload: str, use_tqdm: bool = True
) -> ThroughputResult:
    """All requests arrive at once (offline); greedy with ignore_eos so lengths are fixed."""
    start = time.monotonic()
    for index, item in enumerate(requests):
        prompt = (
            item.prompt if item.prompt is not None else {"prompt_token_ids": item.prompt_token_ids}
        )
        params = SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True)
        engine.add_request(f"bench-{index}", prompt, params)
    finished: list[RequestOutput] = []
    max_running = 0
    with tqdm(total=len(requests), desc=f"bench {workload}", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            max_running = max(max_running, len(engine.scheduler.running))
            for output in outputs:
                if output.finished:
                    finished.append(output)
                    bar.update(1)
    elapsed = time.monotonic() - start
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finished)
    output_tokens = sum(len(out.outputs[0].token_ids) for out in finished)
    stats = engine.scheduler.stats
    return ThroughputResult(
        workload=workload,
        num_requests=len(finished),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        elapsed_s=elapsed,
        output_tokens_per_s=output_tokens / elapsed,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        ttft_ms=Distribution.of([_ttft(out) * 1000 for out in finished]),
        tpot_ms=Distribution.of(
            [_tpot(out) * 1000 for out in finished if len(out.outputs[0].token_ids) > 1]
        ),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        kv_cache_bytes=engine.kv_cache_bytes,
        max_concurrent_requests=max_running,
        num_preemptions=stats.num_preemptions,
        prefix_cache_hit_rate=stats.num_prompt_tokens_cached
        / max(stats.num_prompt_tokens_queried, 1),
    )


def _ttft(output: RequestOutput) -> float:
    assert output.metrics.first_token_time is not None
    return output.metrics.first_token_time - output.metrics.arrival_time


def _tpot(output: RequestOutput) -> float:
    metrics = output.metrics
    assert metrics.first_token_time is not None and metrics.finish_time is not None
    return (metrics.finish_time - metrics.first_token_time) / (len(output.outputs[0].token_ids) - 1)


def write_json(result: ThroughputResult, path: Path, engine_args: dict[str, object]) -> None:
    payload = {"benchmark": "throughput", "engine_args": engine_args, **asdict(result)}
    path.write_text(json.dumps(payload, indent=2), encoding="utf-8")
