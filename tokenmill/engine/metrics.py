"""What a serving engine reports about itself: a state snapshot and Prometheus metrics.

`EngineStats` is read from the engine between steps, so a scrape never sees a half-updated
step. Per-request latencies (TTFT, inter-token, per-output-token, end to end) are timed from
when the caller handed the request over, so they include any wait for the engine loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.kv.disk_tier import DiskTierStats

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 10.0)
REQUEST_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0  # held by requests; cached blocks nobody holds count as free
    num_preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    spec_draft_tokens: int = 0  # drafts verified (speculative decoding)
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    prefix_cache_disk_hit_tokens: int = 0  # the part of the hits the disk tier served
    disk_tier: DiskTierStats | None = None  # None without a disk tier

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineStats:
        scheduler, kv = engine.scheduler, engine.kv_manager
        return cls(
            num_running=len(scheduler.running),
            num_waiting=scheduler.num_waiting,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_in_use=kv.num_blocks - kv.num_free_blocks,
            num_preemptions=scheduler.stats.num_preemptions,
            prefix_cache_queried_tokens=scheduler.stats.num_prompt_tokens_queried,
            prefix_cache_hit_tokens=scheduler.stats.num_prompt_tokens_cached,
            spec_draft_tokens=scheduler.stats.num_draft_tokens,
            spec_accepted_tokens=scheduler.stats.num_accepted_tokens,
            spec_verify_steps=scheduler.stats.num_verify_steps,
            prefix_cache_disk_hit_tokens=scheduler.stats.num_prompt_tokens_from_disk,
            disk_tier=None if engine.disk_tier is None else replace(engine.disk_tier.stats),
        )


class EngineStatsCollector(Collector):
    """Gauges and counters read from the latest EngineStats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "tokenmill_num_requests_running", "Requests being computed", s.num_running
        )
        yield GaugeMetricFamily(
            "tokenmill_num_requests_waiting",
            "Requests queued, preempted ones included",
            s.num_waiting,
        )
        yield GaugeMetricFamily(
            "tokenmill_kv_cache_blocks_in_use", "KV blocks held by requests", s.kv_blocks_in_use
        )
        yield GaugeMetricFamily(
            "tokenmill_kv_cache_usage_ratio",
            "Fraction of KV blocks held by requests (0 to 1)",
            s.kv_blocks_in_use / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        )
        yield CounterMetricFamily(
            "tokenmill_num_preemptions", "Requests preempted to free KV blocks", s.num_preemptions
        )
        yield CounterMetricFamily(
            "tokenmill_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_cache_queried_tokens,
        )
        yield CounterMetricFamily(
            "tokenmill_prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            s.prefix_cache_hit_tokens,
        )
        yield CounterMetricFamily(
            "tokenmill_prefix_cache_disk_hits",
            "Prompt tokens served from the prefix cache's disk tier",
            s.prefix_cache_disk_hit_tokens,
        )
        yield from _disk_tier_metrics(s.disk_tier or DiskTierStats())
        queried = s.prefix_cache_queried_tokens
        yield GaugeMetricFamily(
            "tokenmill_prefix_cache_hit_rate",
            "Prefix-cache hits over queries, in tokens, since start",
            s.prefix_cache_hit_tokens / queried if queried else 0.0,
        )
        yield CounterMetricFamily(
            "tokenmill_spec_decode_num_draft_tokens",
            "Speculative drafts verified by the target",
            s.spec_draft_tokens,
        )
        yield CounterMetricFamily(
            "tokenmill_spec_decode_num_accepted_tokens",
            "Speculative drafts accepted (acceptance rate = accepted / draft)",
            s.spec_accepted_tokens,
        )
        yield CounterMetricFamily(
            "tokenmill_spec_decode_num_verify_steps",
            "Steps that verified drafts (mean accepted length = 1 + accepted / steps)",
            s.spec_verify_steps,
        )
        steps = s.spec_verify_steps
        yield GaugeMetricFamily(
            "tokenmill_spec_decode_mean_accepted_length",
            "Tokens emitted per verify step since start: accepted drafts plus the target's own",
            1 + s.spec_accepted_tokens / steps if steps else 0.0,
        )


def _disk_tier_metrics(stats: DiskTierStats) -> Iterator[Metric]:
    """The disk tier's counters (all zero without one)."""
    described = {
        "hits": "Blocks loaded into the KV pool from the disk tier",
        "writes": "Block files the disk tier wrote",
        "bytes_read": "Bytes the disk tier read",
        "bytes_written": "Bytes the disk tier wrote",
        "evictions": "Blocks the disk tier dropped to stay within its byte budget",
        "expirations": "Blocks the disk tier dropped past the prefix-cache TTL",
        "corrupt": "Damaged block files the disk tier found (recomputed, not served)",
    }
    for name, help_text in described.items():
        yield CounterMetricFamily(f"tokenmill_kv_disk_tier_{name}", help_text, getattr(stats, name))


@dataclass
class _RequestTimes:
    arrival: float
    num_sequences: int
    last_token: float | None = None
    first_token: float | None = None
    num_tokens: int = 0


class EngineMetrics:
    """Prometheus metrics of one engine, in their own registry (several servers can share a
    process, as the tests do)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.finished = Counter(
            "tokenmill_request_success",
            "Finished sequences by finish reason (stop, length, abort, error)",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "tokenmill_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "tokenmill_inter_token_latency_seconds",
            "Time between consecutive outputs of a request that carried new tokens",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "tokenmill_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenmill_e2e_request_latency_seconds",
            "Arrival to the last token",
            buckets=REQUEST_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenmill_prompt_tokens", "Prompt tokens of started requests", registry=r
        )
        self.generation_tokens = Counter(
            "tokenmill_generation_tokens", "Generated tokens", registry=r
        )
        self.batch_size = Histogram(
            "tokenmill_batch_size",
            "Requests computed per engine step that computed any",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        r.register(EngineStatsCollector(stats))
        self._stats = stats
        self._times: dict[str, _RequestTimes] = {}

    def step_done(self, num_requests: int) -> None:
        if num_requests:
            self.batch_size.observe(num_requests)

    def summary(self) -> dict[str, Any]:
        """The seeds' JSON summary (GET /v1/metrics), read from the same series as /metrics:
        finished requests, tokens, mean latency and rate, mean batch size, TTFT and TPOT
        percentiles (estimated within histogram buckets, as Prometheus' histogram_quantile),
        then the engine's state as of its last step (what the playground's live panel draws)."""
        value = self.registry.get_sample_value
        requests = sum(
            sample.value
            for metric in self.finished.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
        e2e_count = value("tokenmill_e2e_request_latency_seconds_count") or 0.0
        e2e_sum = value("tokenmill_e2e_request_latency_seconds_sum") or 0.0
        generated = value("tokenmill_generation_tokens_total") or 0.0
        prompt = value("tokenmill_prompt_tokens_total") or 0.0
        steps = value("tokenmill_batch_size_count") or 0.0
        return {
            "total_requests": int(requests),
            "total_prompt_tokens": int(prompt),
            "total_generated_tokens": int(generated),
            "total_tokens": int(prompt + generated),
            "average_latency_ms": 1000 * e2e_sum / e2e_count if e2e_count else None,
            "average_tokens_per_second": generated / e2e_sum if e2e_sum else None,
            "average_batch_size": (value("tokenmill_batch_size_sum") or 0.0) / steps
            if steps
            else None,
            "ttft_ms": _percentiles_ms(self.ttft),
            "tpot_ms": _percentiles_ms(self.tpot),
            **_state(self._stats()),
        }

    def request_added(self, request_id: str, arrival: float, num_sequences: int = 1) -> None:
        self._times[request_id] = _RequestTimes(arrival, num_sequences)

    def request_output(self, output: RequestOutput, now: float | None = None) -> None:
        times = self._times.get(output.request_id)
        if times is None:
            return
        now = time.monotonic() if now is None else now
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new_tokens = num_tokens - times.num_tokens
        if new_tokens > 0:
            if times.first_token is None:
                times.first_token = now
                self.ttft.observe(now - times.arrival)
                self.prompt_tokens.inc(len(output.prompt_token_ids))
            else:
                self.itl.observe(now - (times.last_token or now))
            times.last_token = now
            times.num_tokens = num_tokens
            self.generation_tokens.inc(new_tokens)
        if output.finished:
            del self._times[output.request_id]
            self.e2e.observe(now - times.arrival)
            longest = max(len(c.token_ids) for c in output.outputs)
            if times.first_token is not None and longest > 1:
                self.tpot.observe((now - times.first_token) / (longest - 1))
            for completion in output.outputs:
                self.finished.labels(completion.finish_reason or "stop").inc()

    def request_ended(self, request_id: str, reason: str) -> None:
        """A request that ended without a finished output: aborted, or failed."""
        times = self._times.pop(request_id, None)
        if times is not None:
            self.finished.labels(reason).inc(times.num_sequences)


def _state(s: EngineStats) -> dict[str, Any]:
    """The gauges and cache / speculation counters of one snapshot; a rate is None while its
    denominator is 0 (no prompt looked up, no draft verified)."""
    queried, drafted = s.prefix_cache_queried_tokens, s.spec_draft_tokens
    steps = s.spec_verify_steps
    return {
        "num_requests_running": s.num_running,
        "num_requests_waiting": s.num_waiting,
        "kv_cache_blocks_in_use": s.kv_blocks_in_use,
        "kv_cache_blocks_total": s.kv_blocks_total,
        "kv_cache_usage": s.kv_blocks_in_use / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        "num_preemptions": s.num_preemptions,
        "prefix_cache_queried_tokens": queried,
        "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
        "prefix_cache_hit_rate": s.prefix_cache_hit_tokens / queried if queried else None,
        "spec_decode_draft_tokens": drafted,
        "spec_decode_accepted_tokens": s.spec_accepted_tokens,
        "spec_decode_acceptance_rate": s.spec_accepted_tokens / drafted if drafted else None,
        "spec_decode_verify_steps": steps,
        # Accepted drafts per verify step; the acceptance length adds the target's own token.
        "spec_decode_accepted_tokens_per_step": s.spec_accepted_tokens / steps if steps else None,
        "spec_decode_mean_accepted_length": 1 + s.spec_accepted_tokens / steps if steps else None,
    }


PERCENTILES = (50, 90, 99)


def _percentiles_ms(histogram: Histogram) -> dict[str, float | None]:
    """p50 / p90 / p99 of a latency histogram in ms, interpolated linearly inside the bucket
    holding each rank; None before any observation (and the last finite bound for a rank that
    falls in the +Inf bucket)."""
    buckets = [
        (float(sample.labels["le"]), sample.value)
        for metric in histogram.collect()
        for sample in metric.samples
        if sample.name.endswith("_bucket")
    ]
    total = buckets[-1][1] if buckets else 0.0
    result: dict[str, float | None] = {}
    for q in PERCENTILES:
        result[f"p{q}"] = None if not total else 1000 * _bucket_quantile(buckets, q / 100 * total)
    return result


def _bucket_quantile(buckets: list[tuple[float, float]], rank: float) -> float:
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, cumulative
    return lower
