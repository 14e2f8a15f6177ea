"""`tokenmill bench serve`: load any OpenAI-compatible server and measure what its users feel.

Requests stream from `/v1/completions` (the one endpoint that takes token ids, so every server
sees the same tokens) with `stream_options.include_usage`, greedy and `ignore_eos`, so tokenmill,
llama.cpp's llama-server and vLLM produce the same number of tokens. They arrive as a seeded
Poisson process at `request_rate` per second (or all at once), at most `max_concurrency` in
flight. Times are taken on arrival of each streamed chunk: time to first token (TTFT), the gaps
between chunks (ITL), time per output token after the first (TPOT) and end-to-end latency.

With `json_schemas` = n, request i is held to the i mod n-th of n distinct JSON schemas
(bench/structured.py) through vLLM's `structured_outputs` field, so the server compiles
grammars under load; such a request ends when its JSON is complete, `ignore_eos` or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from tokenmill.bench.report import key_value_table
from tokenmill.bench.stats import Distribution
from tokenmill.bench.workloads import BenchRequest

SLO_FIELDS = ("ttft_ms", "tpot_ms", "e2el_ms")


def parse_goodput(text: str) -> dict[str, float]:
    """`ttft_ms=500,tpot_ms=50` -> service-level objectives a request must all meet to count."""
    slos: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SLO_FIELDS:
            raise ValueError(
                f"goodput takes name=milliseconds pairs with names {', '.join(SLO_FIELDS)}; "
                f"got {part!r}"
            )
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"goodput {name} must be a number of milliseconds") from exc
        if slos[name] <= 0:
            raise ValueError(f"goodput {name} must be > 0 ms, got {value}")
    if not slos:
        raise ValueError("goodput needs at least one objective, e.g. ttft_ms=500")
    return slos


def parse_request_rate(text: str) -> float:
    """Requests per second, or `inf` for all at once."""
    try:
        rate = float(text)
    except ValueError as exc:
        raise ValueError(f"request_rate must be a number or inf, got {text!r}") from exc
    if not rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {text!r}")
    return rate


def arrival_offsets_s(count: int, request_rate: float, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: exponential gaps of mean 1/rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


@dataclass(frozen=True)
class ServeConfig:
    base_url: str
    model: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 3600.0
    json_schemas: int = 0  # request i held to schema i mod this many; 0: unconstrained

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.json_schemas < 0:
            raise ValueError(f"json_schemas must be >= 0, got {self.json_schemas}")

    @property
    def completions_url(self) -> str:
        """Accepts `http://host:port` and `http://host:port/v1` alike."""
        return f"{self.api_root}/completions"

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else f"{root}/v1"


@dataclass
class RequestTrace:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # as the server's usage reports them (prefix-cache hits)
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slos: dict[str, float]) -> bool:
        measured = {
            "ttft_ms": self.ttft_s * 1000,
            "tpot_ms": (self.tpot_s or 0.0) * 1000,
            "e2el_ms": self.e2e_s * 1000,
        }
        return all(measured[name] <= limit for name, limit in slos.items())


@dataclass
class ServeResult:
    base_url: str
    model: str
    request_rate: float | None  # None: all requests at once
    max_concurrency: int | None
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hit_rate: float | None  # cached prompt tokens / prompt tokens, from usage
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float
    goodput_slos: dict[str, float]
    goodput: float | None  # requests per second that met every objective
    goodput_requests: int | None  # how many requests met every objective
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    first_error: str | None
    json_schemas: int = 0  # distinct JSON schemas the requests were held to (0: none)

    def table(self) -> str:
        rate = "all at once" if self.request_rate is None else f"{self.request_rate:g}/s"
        rows = [
            ("server", f"{self.base_url} ({self.model})"),
            ("request rate", f"{rate}, max concurrency {self.max_concurrency or 'unlimited'}"),
            ("JSON schemas", f"{self.json_schemas} distinct" if self.json_schemas else "none"),
            ("completed / failed", f"{self.completed} / {self.failed}"),
            ("duration", f"{self.duration_s:.2f} s"),
            ("prompt / output tokens", f"{self.prompt_tokens} / {self.output_tokens}"),
            ("prefix hit rate", _percent(self.prefix_hit_rate)),
            ("request throughput", f"{self.request_throughput:.2f} req/s"),
            ("output throughput", f"{self.output_throughput:.1f} tok/s"),
            ("total token throughput", f"{self.total_token_throughput:.1f} tok/s"),
        ]
        if self.goodput is not None:
            slos = ", ".join(f"{k} <= {v:g}" for k, v in self.goodput_slos.items())
            rows.append(("goodput", f"{self.goodput:.2f} req/s ({slos})"))
        for name, dist in [
            ("TTFT", self.ttft_ms),
            ("TPOT", self.tpot_ms),
            ("ITL", self.itl_ms),
            ("E2E latency", self.e2el_ms),
        ]:
            rows.append((f"{name} mean / p50 / p90 / p99", dist.summary(with_p90=True)))
        if self.first_error:
            rows.append(("first error", self.first_error))
        return key_value_table(rows)


def run_serve(
    config: ServeConfig, requests: list[BenchRequest], use_tqdm: bool = True
) -> ServeResult:
    return asyncio.run(_run(config, requests, use_tqdm))


async def _run(config: ServeConfig, requests: list[BenchRequest], use_tqdm: bool) -> ServeResult:
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        model = config.model or await _served_model(client, config)
        # One short request first: a wrong URL or model fails here with the server's words,
        # and one-time warm-up costs stay out of the measurement.
        warmup = await _stream_completion(client, config, model, requests[0], max_tokens=2)
        if warmup.error:
            raise ValueError(f"{config.completions_url}: {warmup.error}")
        offsets = arrival_offsets_s(len(requests), config.request_rate, config.seed)
        schemas = _request_schemas(config, len(requests))
        gate = (
            asyncio.Semaphore(config.max_concurrency)
            if config.max_concurrency
            else contextlib.nullcontext()
        )
        done = [asyncio.Event() for _ in requests]  # a session's next turn waits for its last
        with tqdm(total=len(requests), desc="bench serve", disable=not use_tqdm) as bar:
            start = time.perf_counter()

            async def one(index: int, request: BenchRequest, offset: float) -> RequestTrace:
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                if request.after is not None:
                    await done[request.after].wait()
                async with gate:
                    trace = await _stream_completion(
                        client, config, model, request, schema=schemas[index]
                    )
                done[index].set()
                bar.update(1)
                return trace

            traces = await asyncio.gather(
                *(one(i, r, t) for i, (r, t) in enumerate(zip(requests, offsets, strict=True)))
            )
            duration = time.perf_counter() - start
    return _summarize(config, model, list(traces), duration)


async def _served_model(client: httpx.AsyncClient, config: ServeConfig) -> str:
    """The first model the server lists, for servers that insist on a model name."""
    try:
        response = await client.get(f"{config.api_root}/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"could not list models at {config.api_root}/models ({exc}); pass --model"
        ) from exc


async def _stream_completion(
    client: httpx.AsyncClient,
    config: ServeConfig,
    model: str,
    request: BenchRequest,
    max_tokens: int | None = None,
    schema: dict | None = None,
) -> RequestTrace:
    body: dict = {
        "model": model,
        "prompt": request.prompt_input,
        "max_tokens": max_tokens or request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is not None:
        body["structured_outputs"] = {"json": schema}
    trace = RequestTrace(prompt_tokens=len(request.prompt_token_ids or []))
    num_chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", config.completions_url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                trace.error = f"HTTP {response.status_code}: {detail[:300]}"
                return trace
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    trace.error = f"server error: {json.dumps(chunk['error'])[:300]}"
                    return trace
                if chunk.get("usage"):
                    trace.prompt_tokens = chunk["usage"].get("prompt_tokens", trace.prompt_tokens)
                    trace.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    trace.cached_prompt_tokens = details.get("cached_tokens") or 0
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        trace.ttft_s = now - start
                    else:
                        trace.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        return trace
    trace.e2e_s = time.perf_counter() - start
    if num_chunks == 0:
        trace.error = "the stream carried no text"
    # Servers that ignore include_usage: count chunks, one token each in every server we know.
    trace.output_tokens = trace.output_tokens or num_chunks
    return trace


def _request_schemas(config: ServeConfig, count: int) -> list[dict | None]:
    """Each request's JSON schema, None for all when the run is unconstrained."""
    if not config.json_schemas:
        return [None] * count
    from tokenmill.bench.structured import schema_variants  # imports the engine: only if used

    variants = schema_variants(config.json_schemas, config.seed)
    return [variants[index % len(variants)] for index in range(count)]


def requests_meeting(traces: list[RequestTrace], slos: dict[str, float]) -> int:
    """How many requests completed within every objective: goodput's numerator (a failed
    request meets none)."""
    return sum(t.error is None and t.meets(slos) for t in traces)


def _summarize(
    config: ServeConfig, model: str, traces: list[RequestTrace], duration: float
) -> ServeResult:
    done = [t for t in traces if t.error is None]
    failed = [t for t in traces if t.error is not None]
    prompt_tokens = sum(t.prompt_tokens for t in done)
    output_tokens = sum(t.output_tokens for t in done)
    cached_tokens = sum(t.cached_prompt_tokens for t in done)
    met = requests_meeting(traces, config.goodput) if config.goodput else None
    return ServeResult(
        base_url=config.base_url,
        model=model,
        request_rate=None if math.isinf(config.request_rate) else config.request_rate,
        max_concurrency=config.max_concurrency,
        num_requests=len(traces),
        completed=len(done),
        failed=len(failed),
        duration_s=duration,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        prefix_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else None,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        goodput_slos=dict(config.goodput),
        goodput=None if met is None else met / duration,
        goodput_requests=met,
        ttft_ms=Distribution.of([t.ttft_s * 1000 for t in done]),
        tpot_ms=Distribution.of([t.tpot_s * 1000 for t in done if t.tpot_s is not None]),
        itl_ms=Distribution.of([gap * 1000 for t in done for gap in t.itl_s]),
        e2el_ms=Distribution.of([t.e2e_s * 1000 for t in done]),
        first_error=failed[0].error if failed else None,
        json_schemas=config.json_schemas,
    )


def _percent(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.1f} %"
