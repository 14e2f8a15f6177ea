"""`tokenmill bench ablate`: each technique off and on, on the real model, in one run.

Every experiment loads nothing itself: the engines share one loaded model and differ only in
the switch under test, so a difference is the technique's. Steps are timed from outside
(`LLMEngine.step()` wall time); nothing inside the engine is instrumented. `FULL` is the run
docs/benchmarks.md reports (about 15 minutes on 2 cores, the speculative-decoding experiments
about 4 of them); `QUICK` shrinks every experiment to a few tokens so the whole command runs in
seconds.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.bench.comparison import Comparison, comparison_table
from tokenmill.bench.plots import bar_plot, line_plot
from tokenmill.bench.report import write_json
from tokenmill.bench.throughput import ThroughputResult, run_throughput
from tokenmill.bench.workloads import (
    BenchRequest,
    load_workload,
    random_requests,
    random_token_ids,
)
from tokenmill.config import EngineArgs, parse_dtype
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.kv.layout import kv_bytes_per_token
from tokenmill.kv.quantized import cache_bytes, kv_head_bytes
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.sampling.params import SamplingParams


@dataclass(frozen=True)
class AblateSizes:
    """How big each experiment is. The batch workload is `random_requests(1, ...)`, which with
    the full sizes is exactly batch64."""

    kv_prompt_tokens: int
    kv_new_tokens: int
    batch_requests: int
    batch_prompt_len: tuple[int, int]
    batch_max_tokens: tuple[int, int]
    batch_max_num_seqs: int  # for both schedulers: a static batch is this many requests
    prefix_tokens: int  # the shared "system prompt"
    prefix_suffix_tokens: int
    prefix_requests: int
    prefix_new_tokens: int
    chunk_prompt_tokens: int  # the long prompt that arrives while others decode
    chunk_budget: int  # max_num_batched_tokens with chunked prefill on
    chunk_decodes: int
    chunk_decode_prompt_tokens: int
    chunk_decode_tokens: int
    chunk_warm_steps: int  # decode steps before the long prompt arrives
    memory_max_model_len: int  # the span a contiguous cache reserves per request
    memory_pool_requests: int  # pool size, in max-length requests
    spec_rewrite_tokens: int  # generated on the `rewrite` workload (the passage is ~100 tokens)
    spec_chat_tokens: int  # generated on the `chat` workload
    spec_batch_requests: int  # all of them running at once
    spec_batch_prompt_len: tuple[int, int]
    spec_batch_max_tokens: tuple[int, int]
    loop_batch_requests: int  # the decode loop's small batch, all running at once
    loop_new_tokens: int  # generated per request of that batch


FULL = AblateSizes(
    kv_prompt_tokens=32,
    kv_new_tokens=256,
    batch_requests=64,
    batch_prompt_len=(32, 256),
    batch_max_tokens=(32, 256),
    batch_max_num_seqs=16,
    prefix_tokens=1024,
    prefix_suffix_tokens=32,
    prefix_requests=8,
    prefix_new_tokens=8,
    chunk_prompt_tokens=2000,
    chunk_budget=256,
    chunk_decodes=4,
    chunk_decode_prompt_tokens=32,
    chunk_decode_tokens=48,
    chunk_warm_steps=4,
    memory_max_model_len=512,
    memory_pool_requests=17,
    spec_rewrite_tokens=100,
    spec_chat_tokens=128,
    spec_batch_requests=32,
    spec_batch_prompt_len=(32, 256),
    spec_batch_max_tokens=(16, 32),
    loop_batch_requests=8,
    loop_new_tokens=128,
)

QUICK = AblateSizes(
    kv_prompt_tokens=8,
    kv_new_tokens=8,
    batch_requests=6,
    batch_prompt_len=(8, 24),
    batch_max_tokens=(3, 8),
    batch_max_num_seqs=3,
    prefix_tokens=64,
    prefix_suffix_tokens=8,
    prefix_requests=3,
    prefix_new_tokens=2,
    chunk_prompt_tokens=96,
    chunk_budget=32,
    chunk_decodes=2,
    chunk_decode_prompt_tokens=8,
    chunk_decode_tokens=12,
    chunk_warm_steps=2,
    memory_max_model_len=48,
    memory_pool_requests=2,
    spec_rewrite_tokens=12,
    spec_chat_tokens=8,
    spec_batch_requests=6,
    spec_batch_prompt_len=(8, 24),
    spec_batch_max_tokens=(3, 8),
    loop_batch_requests=3,
    loop_new_tokens=4,
)


@dataclass
class Experiment:
    """What one technique's experiment hands back: verdict rows, raw series, its chart."""

    rows: list[Comparison]
    data: dict[str, Any]
    plot: Path


@dataclass
class AblateContext:
    loaded: LoadedModel
    base: EngineArgs
    sizes: AblateSizes
    out_dir: Path

    def engine(self, **switches: Any) -> LLMEngine:
        """A fresh engine on the shared model, warmed up so one-time costs are not measured."""
        engine = LLMEngine(replace(self.base, **switches), self.loaded)
        warm_up = BenchRequest(random_token_ids(random.Random(99), 8), None, 2)
        run_throughput(engine, [warm_up], "warm-up", use_tqdm=False)
        return engine


class FinishTimes:
    """A step observer: seconds since it was made at which each request finished."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seconds: list[float] = []

    def __call__(self, _: LLMEngine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic() - self.start
        self.seconds.extend(now for out in outputs if out.finished)


class SlotOccupancy:
    """A step observer: KV slots the running requests hold, and how many of them hold KV."""

    def __init__(self) -> None:
        self.reserved: list[int] = []
        self.used: list[int] = []

    def __call__(self, engine: LLMEngine, _: list[RequestOutput]) -> None:
        kv = engine.kv_manager
        assert kv is not None
        running = engine.scheduler.running
        if not running:
            return
        self.reserved.append(sum(kv.num_blocks_held(r.request_id) for r in running) * kv.block_size)
        self.used.append(sum(r.num_computed_tokens for r in running))


class FinishedTokens:
    """A step observer: each finished request's output token ids, keyed by its prompt (the
    workloads' prompts are distinct), so two engines' outputs can be compared."""

    def __init__(self) -> None:
        self.by_prompt: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, _: LLMEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.by_prompt[tuple(out.prompt_token_ids)] = list(out.outputs[0].token_ids)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def kv_cache(ctx: AblateContext) -> Experiment:
    """No KV cache recomputes the whole sequence each step, so a step costs O(length); with the
    cache a decode step computes one token whatever the length."""
    sizes = ctx.sizes
    prompt = random_token_ids(random.Random(3), sizes.kv_prompt_tokens)
    curves: dict[str, tuple[list[float], list[float]]] = {}
    totals: dict[str, float] = {}
    growth: dict[str, float] = {}
    for mode in ("none", "paged"):
        engine = ctx.engine(kv_cache=mode)
        engine.add_request("kv", prompt, _greedy(sizes.kv_new_tokens))
        lengths, step_ms, total = [], [], 0.0
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            total += elapsed
            generated = len(outputs[0].outputs[0].token_ids) if outputs else 0
            if generated > 1:  # a decode step; the first step is the prompt's prefill
                lengths.append(float(len(prompt) + generated - 1))
                step_ms.append(elapsed * 1000)
        curves[mode], totals[mode] = (lengths, step_ms), total
        window = max(1, len(step_ms) // 8)
        growth[mode] = statistics.median(step_ms[-window:]) / statistics.median(step_ms[:window])
        del engine
    plot = line_plot(
        ctx.out_dir / "kv_cache_step_time.png",
        "Decode step time vs sequence length",
        "sequence length (tokens)",
        "step time (ms)",
        {f"kv_cache={mode}": curve for mode, curve in curves.items()},
    )
    new = sizes.kv_new_tokens
    rows = [
        Comparison(
            "KV cache",
            f"time to generate {new} tokens ({sizes.kv_prompt_tokens}-token prompt)",
            "s",
            "none",
            totals["none"],
            "paged",
            totals["paged"],
            higher_is_better=False,
        ),
        Comparison(
            "KV cache",
            "decode step time, longest / shortest sequence",
            "x",
            "none",
            growth["none"],
            "paged",
            growth["paged"],
            higher_is_better=False,
        ),
    ]
    data = {"step_ms_by_length": curves, "total_s": totals, "step_time_growth": growth}
    return Experiment(rows, data, plot)


def batching(ctx: AblateContext) -> Experiment:
    """A static batch runs until its longest request ends; continuous batching refills each
    freed slot at the next step. Both hold at most `batch_max_num_seqs` requests at once."""
    sizes = ctx.sizes
    requests = _batch_requests(sizes)
    results = {}
    finished_at: dict[str, list[float]] = {}
    for scheduler in ("static", "continuous"):
        engine = ctx.engine(
            kv_cache="paged", scheduler=scheduler, max_num_seqs=sizes.batch_max_num_seqs
        )
        finish_times = FinishTimes()
        results[scheduler] = run_throughput(
            engine, requests, f"batch ({scheduler})", on_step=finish_times
        )
        finished_at[scheduler] = finish_times.seconds
        del engine
    plot = line_plot(
        ctx.out_dir / "batching_finished_requests.png",
        f"Requests finished over time ({len(requests)} requests, "
        f"{sizes.batch_max_num_seqs} at once)",
        "seconds since all requests arrived",
        "requests finished",
        {
            f"scheduler={name}": (times, [float(i + 1) for i in range(len(times))])
            for name, times in finished_at.items()
        },
        steps=True,
    )
    static, continuous = results["static"], results["continuous"]
    workload = f"{len(requests)} requests, {sizes.batch_max_num_seqs} at once"
    rows = [
        Comparison(
            "batching",
            f"output tokens/s ({workload})",
            "tok/s",
            "static",
            static.output_tokens_per_s,
            "continuous",
            continuous.output_tokens_per_s,
            higher_is_better=True,
        ),
        Comparison(
            "batching",
            "p50 request latency",
            "s",
            "static",
            static.latency_ms.p50 / 1000,
            "continuous",
            continuous.latency_ms.p50 / 1000,
            higher_is_better=False,
        ),
        Comparison(
            "batching",
            "p99 request latency",
            "s",
            "static",
            static.latency_ms.p99 / 1000,
            "continuous",
            continuous.latency_ms.p99 / 1000,
            higher_is_better=False,
        ),
    ]
    return Experiment(rows, {"results": results, "finished_at_s": finished_at}, plot)


def prefix_caching(ctx: AblateContext) -> Experiment:
    """Requests that share a long system prompt, one after another: with the prefix cache each
    later request computes only its own suffix."""
    sizes = ctx.sizes
    rng = random.Random(5)
    shared = random_token_ids(rng, sizes.prefix_tokens)
    prompts = [
        shared + random_token_ids(rng, sizes.prefix_suffix_tokens)
        for _ in range(sizes.prefix_requests)
    ]
    ttft_ms: dict[str, list[float]] = {}
    cached_tokens: dict[str, list[int]] = {}
    for name, enabled in (("off", False), ("on", True)):
        engine = ctx.engine(kv_cache="paged", enable_prefix_caching=enabled)
        ttft_ms[name], cached_tokens[name] = [], []
        for prompt in prompts:
            request = BenchRequest(prompt, None, sizes.prefix_new_tokens)
            result = run_throughput(engine, [request], "prefix", use_tqdm=False)
            ttft_ms[name].append(result.ttft_ms.mean)
            cached_tokens[name].append(round(result.prefix_cache_hit_rate * len(prompt)))
        del engine
    plot = line_plot(
        ctx.out_dir / "prefix_caching_ttft.png",
        f"TTFT of requests sharing a {sizes.prefix_tokens}-token prefix, one after another",
        "request",
        "time to first token (ms)",
        {
            f"prefix caching {name}": ([float(i + 1) for i in range(len(v))], v)
            for name, v in ttft_ms.items()
        },
    )
    later = {name: statistics.fmean(v[1:]) for name, v in ttft_ms.items()}
    rows = [
        Comparison(
            "prefix caching",
            f"mean TTFT of requests 2-{sizes.prefix_requests} "
            f"(shared {sizes.prefix_tokens}-token prefix)",
            "ms",
            "off",
            later["off"],
            "on",
            later["on"],
            higher_is_better=False,
        )
    ]
    return Experiment(rows, {"ttft_ms": ttft_ms, "cached_prompt_tokens": cached_tokens}, plot)


def chunked_prefill(ctx: AblateContext) -> Experiment:
    """Decodes are running when a long prompt arrives. Unchunked, its whole prefill shares one
    step with them and they stall for it; chunked, it is cut into budget-sized pieces that ride
    along with the decode tokens."""
    sizes = ctx.sizes
    rng = random.Random(4)
    long_prompt = random_token_ids(rng, sizes.chunk_prompt_tokens)
    decode_prompts = [
        random_token_ids(rng, sizes.chunk_decode_prompt_tokens) for _ in range(sizes.chunk_decodes)
    ]
    # Unchunked, a prompt waits until one step's budget holds it whole, so the budget must.
    unchunked_budget = max(
        ctx.base.max_num_batched_tokens, sizes.chunk_prompt_tokens + sizes.chunk_decodes
    )
    variants = {
        "off": {"enable_chunked_prefill": False, "max_num_batched_tokens": unchunked_budget},
        "on": {"enable_chunked_prefill": True, "max_num_batched_tokens": sizes.chunk_budget},
    }
    worst_itl_ms, long_ttft_ms = {}, {}
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for name, switches in variants.items():
        engine = ctx.engine(kv_cache="paged", **switches)
        for index, prompt in enumerate(decode_prompts):
            engine.add_request(f"decode-{index}", prompt, _greedy(sizes.chunk_decode_tokens))
        token_times: dict[str, list[float]] = defaultdict(list)
        arrival = first_token = None
        steps = 0
        while engine.has_unfinished_requests():
            if steps == sizes.chunk_warm_steps:
                engine.add_request("long", long_prompt, _greedy(1))
                arrival = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            steps += 1
            for out in outputs:
                if out.request_id == "long":
                    first_token = now
                else:
                    token_times[out.request_id].append(now)
        assert arrival is not None and first_token is not None
        gaps = [
            (end - arrival, (end - begin) * 1000)
            for times in token_times.values()
            for begin, end in itertools.pairwise(times)
        ]
        gaps.sort()
        during = [gap for end, gap in gaps if 0 < end <= first_token - arrival]
        worst_itl_ms[name] = max(during)
        long_ttft_ms[name] = (first_token - arrival) * 1000
        curves[f"chunked prefill {name}"] = ([e for e, _ in gaps], [g for _, g in gaps])
        del engine
    plot = line_plot(
        ctx.out_dir / "chunked_prefill_itl.png",
        f"Inter-token latency of {sizes.chunk_decodes} decodes; "
        f"a {sizes.chunk_prompt_tokens}-token prompt arrives at 0",
        "seconds since the long prompt arrived",
        "inter-token latency (ms)",
        curves,
    )
    rows = [
        Comparison(
            "chunked prefill",
            f"worst inter-token latency of {sizes.chunk_decodes} running decodes while a "
            f"{sizes.chunk_prompt_tokens}-token prompt prefills",
            "ms",
            "off",
            worst_itl_ms["off"],
            "on",
            worst_itl_ms["on"],
            higher_is_better=False,
        ),
        Comparison(
            "chunked prefill",
            f"TTFT of the {sizes.chunk_prompt_tokens}-token prompt (the price of chunking)",
            "ms",
            "off",
            long_ttft_ms["off"],
            "on",
            long_ttft_ms["on"],
            higher_is_better=False,
        ),
    ]
    data = {
        "worst_itl_ms": worst_itl_ms,
        "long_prompt_ttft_ms": long_ttft_ms,
        "budgets": {n: s["max_num_batched_tokens"] for n, s in variants.items()},
    }
    return Experiment(rows, data, plot)


def kv_memory(ctx: AblateContext) -> Experiment:
    """The same pool, two ways to hand it out: a max-length span per request at admission
    (contiguous) or a block at a time as tokens arrive (paged)."""
    sizes = ctx.sizes
    config = ctx.loaded.config
    dtype = parse_dtype(ctx.base.dtype)
    kv_dtype = ctx.base.kv_cache_dtype
    per_token = kv_bytes_per_token(config, dtype, kv_dtype)
    head_bytes = kv_head_bytes(kv_dtype, config.head_dim, dtype)
    pool_bytes = sizes.memory_pool_requests * sizes.memory_max_model_len * per_token
    requests = _batch_requests(sizes)
    measured_per_token = 0.0
    unused: dict[str, float] = {}
    concurrency: dict[str, int] = {}
    throughput: dict[str, float] = {}
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for mode in ("contiguous", "paged"):
        engine = ctx.engine(
            kv_cache=mode,
            kv_cache_memory=pool_bytes,
            max_model_len=sizes.memory_max_model_len,
            max_num_seqs=len(requests),
        )
        occupancy = SlotOccupancy()
        result = run_throughput(engine, requests, f"batch ({mode} KV)", on_step=occupancy)
        reserved_slots, used_slots = occupancy.reserved, occupancy.used
        assert engine.runner.kv_caches is not None
        pool_tensor_bytes = sum(cache_bytes(cache) for cache in engine.runner.kv_caches)
        measured_per_token = pool_tensor_bytes / (engine.num_blocks * engine.args.block_size)
        unused[mode] = 1 - sum(used_slots) / max(sum(reserved_slots), 1)
        concurrency[mode] = result.max_concurrent_requests
        throughput[mode] = result.output_tokens_per_s
        curves[f"kv_cache={mode}"] = (
            [float(i) for i in range(len(used_slots))],
            [1 - u / r for u, r in zip(used_slots, reserved_slots, strict=True)],
        )
        del engine
    plot = line_plot(
        ctx.out_dir / "kv_memory_unused.png",
        f"Reserved but unused KV slots ({sizes.memory_pool_requests} x "
        f"{sizes.memory_max_model_len}-token pool)",
        "engine step",
        "fraction of held slots not yet written",
        curves,
    )
    formula = (
        f"2 x {config.num_hidden_layers} layers x {config.num_key_value_heads} kv_heads x "
        f"{head_bytes} bytes per head ({config.head_dim} values"
        + ("" if kv_dtype == "auto" else " + a 4-byte scale")
        + ")"
    )
    pool = f"{sizes.memory_pool_requests} x {sizes.memory_max_model_len}-token pool"
    rows = [
        Comparison(
            "KV memory",
            f"bytes per token: formula ({formula}) vs the allocated pool",
            "B",
            "formula",
            float(per_token),
            "measured pool",
            measured_per_token,
            higher_is_better=False,
        ),
        Comparison(
            "KV memory",
            f"held slots not yet written, mean over steps ({pool})",
            "%",
            "contiguous",
            unused["contiguous"],
            "paged",
            unused["paged"],
            higher_is_better=False,
        ),
        Comparison(
            "KV memory",
            f"most requests running at once ({pool})",
            "reqs",
            "contiguous",
            concurrency["contiguous"],
            "paged",
            concurrency["paged"],
            higher_is_better=True,
        ),
        Comparison(
            "KV memory",
            f"output tokens/s ({pool})",
            "tok/s",
            "contiguous",
            throughput["contiguous"],
            "paged",
            throughput["paged"],
            higher_is_better=True,
        ),
    ]
    data = {
        "bytes_per_token_formula": per_token,
        "bytes_per_token_measured": measured_per_token,
        "pool_bytes": pool_bytes,
        "unused_fraction": unused,
        "max_concurrent_requests": concurrency,
        "output_tokens_per_s": throughput,
    }
    return Experiment(rows, data, plot)


def speculative(ctx: AblateContext) -> Experiment:
    """One stream is bound by reading the weights, so verifying K drafts in one pass costs about
    one token's step and every accepted draft saves a step. Prompt lookup (`ngram`) where the
    output repeats the input; on an open question, the shipped EAGLE head and the target's own
    checkpoint quantized to int4 as a draft model."""
    sizes = ctx.sizes
    int4_copy = {"draft_model": ctx.base.model, "draft_quantization": "int4"}
    cases = (
        ("ngram", "rewrite", "copy a passage", sizes.spec_rewrite_tokens, {}),
        ("eagle", "chat", "an open question", sizes.spec_chat_tokens, {}),
        (
            "draft",
            "chat",
            "an open question, an int4 copy drafting",
            sizes.spec_chat_tokens,
            int4_copy,
        ),
    )
    rows: list[Comparison] = []
    bars: dict[str, dict[str, float]] = {}
    data: dict[str, Any] = {}
    baselines: dict[str, tuple[ThroughputResult, dict[tuple[int, ...], list[int]]]] = {}
    for method, workload, task, max_tokens, draft in cases:
        requests = [replace(r, max_tokens=max_tokens) for r in load_workload(workload)]
        if workload not in baselines:
            baselines[workload] = _speculation_run(ctx, requests, workload, speculative_method=None)
        off, off_tokens = baselines[workload]
        on, on_tokens = _speculation_run(
            ctx, requests, workload, speculative_method=method, **draft
        )
        match = off_tokens == on_tokens
        bars[f"{method} on {workload}"] = {
            "off": off.output_tokens_per_s,
            "on": on.output_tokens_per_s,
        }
        data[method] = {"workload": workload, "off": off, "on": on, "outputs_match": match}
        technique = f"speculative decoding ({method})"
        rows += [
            Comparison(
                technique,
                f"output tok/s, one stream, `{workload}` ({task}, {max_tokens} tokens); "
                f"greedy outputs identical: {_yes_no(match)}",
                "tok/s",
                "off",
                off.output_tokens_per_s,
                method,
                on.output_tokens_per_s,
                higher_is_better=True,
            ),
            Comparison(
                technique,
                "TPOT, mean time per output token after the first (decode only)",
                "ms",
                "off",
                off.tpot_ms.mean,
                method,
                on.tpot_ms.mean,
                higher_is_better=False,
            ),
            Comparison(
                technique,
                "mean accepted length: tokens emitted per verify step (a plain step: 1)",
                "tok",
                "off",
                1.0,
                method,
                on.spec_mean_accepted_length,
                higher_is_better=True,
            ),
            Comparison(
                technique,
                "drafts accepted (acceptance rate; off drafts nothing)",
                "%",
                "off",
                0.0,
                method,
                on.spec_acceptance_rate,
                higher_is_better=True,
            ),
        ]
    plot = bar_plot(
        ctx.out_dir / "speculative_single_stream.png",
        "Single-stream output tokens/s, speculative decoding off and on",
        "output tokens/s",
        bars,
    )
    return Experiment(rows, data, plot)


SPECULATIVE_BATCH_METHOD = "ngram"  # free to draft, so its cost in a batch is all verification


def speculative_batch(ctx: AblateContext) -> Experiment:
    """In a big batch the forward pass is bound by arithmetic, not by reading weights, so every
    draft row verified slows every request in it; the default policy switches speculation off
    above `speculative_disable_batch_size` running requests."""
    sizes = ctx.sizes
    requests = random_requests(
        2, sizes.spec_batch_requests, sizes.spec_batch_prompt_len, sizes.spec_batch_max_tokens
    )
    method = SPECULATIVE_BATCH_METHOD
    default_limit = ctx.base.speculative_disable_batch_size
    variants: dict[str, dict[str, Any]] = {
        "off": {"speculative_method": None},
        "forced on": {
            "speculative_method": method,
            "speculative_disable_batch_size": len(requests),
        },
        "default policy": {
            "speculative_method": method,
            "speculative_disable_batch_size": default_limit,
        },
    }
    results: dict[str, ThroughputResult] = {}
    tokens: dict[str, dict[tuple[int, ...], list[int]]] = {}
    for name, switches in variants.items():
        results[name], tokens[name] = _speculation_run(
            ctx, requests, "random batch", max_num_seqs=len(requests), **switches
        )
    match = {name: tokens[name] == tokens["off"] for name in ("forced on", "default policy")}
    (shortest, longest), (fewest, most) = sizes.spec_batch_prompt_len, sizes.spec_batch_max_tokens
    workload = (
        f"{len(requests)} requests at once: random-token prompts of {shortest}-{longest} "
        f"tokens, {fewest}-{most} new tokens each"
    )
    plot = bar_plot(
        ctx.out_dir / "speculative_batch.png",
        f"Output tokens/s, {len(requests)} requests at once, {method} speculation",
        "output tokens/s",
        {
            f"{method}, {len(requests)} requests": {
                n: r.output_tokens_per_s for n, r in results.items()
            }
        },
    )
    off = results["off"].output_tokens_per_s
    technique = f"speculative decoding ({method}, batch)"
    rows = [
        Comparison(
            technique,
            f"output tok/s, {workload}; speculation forced on for every request "
            f"(disable batch size {len(requests)}); "
            f"greedy outputs identical: {_yes_no(match['forced on'])}",
            "tok/s",
            "off",
            off,
            "forced on",
            results["forced on"].output_tokens_per_s,
            higher_is_better=True,
        ),
        Comparison(
            technique,
            f"output tok/s, the same batch; the default policy: off while more than "
            f"{default_limit} requests run; "
            f"greedy outputs identical: {_yes_no(match['default policy'])}",
            "tok/s",
            "off",
            off,
            "default policy",
            results["default policy"].output_tokens_per_s,
            higher_is_better=True,
        ),
    ]
    data = {"method": method, "results": results, "outputs_match": match}
    return Experiment(rows, data, plot)


def decode_loop(ctx: AblateContext) -> Experiment:
    """A decode step makes about 360 kernel calls; from Python each costs module dispatch and
    input checks on top of the kernel. The native loop makes the same calls from C++, so the
    outputs are identical and only that host time goes."""
    sizes = ctx.sizes
    one = [BenchRequest(random_token_ids(random.Random(0), 32), None, sizes.kv_new_tokens)]
    count = sizes.loop_batch_requests
    batch = random_requests(3, count, (32, 64), (sizes.loop_new_tokens, sizes.loop_new_tokens))
    cases = (
        ("one stream", f"one stream, {sizes.kv_new_tokens} new tokens", one),
        (f"{count} streams", f"{count} streams at once, {sizes.loop_new_tokens} each", batch),
    )
    rows: list[Comparison] = []
    bars: dict[str, dict[str, float]] = {}
    data: dict[str, Any] = {}
    for name, workload, requests in cases:
        results, tokens = {}, {}
        for loop in ("python", "native"):
            results[loop], tokens[loop] = _greedy_run(
                ctx, requests, f"{name} ({loop} loop)", decode_loop=loop, speculative_method=None
            )
        match = tokens["python"] == tokens["native"]
        python, native = results["python"], results["native"]
        bars[name] = {loop: r.output_tokens_per_s for loop, r in results.items()}
        data[name] = {"python": python, "native": native, "outputs_match": match}
        rows += [
            Comparison(
                "native decode loop",
                f"output tok/s, {workload}; greedy outputs identical: {_yes_no(match)}",
                "tok/s",
                "python",
                python.output_tokens_per_s,
                "native",
                native.output_tokens_per_s,
                higher_is_better=True,
            ),
            Comparison(
                "native decode loop",
                f"TPOT, {workload}",
                "ms",
                "python",
                python.tpot_ms.mean,
                "native",
                native.tpot_ms.mean,
                higher_is_better=False,
            ),
        ]
    plot = bar_plot(
        ctx.out_dir / "decode_loop.png",
        "Output tokens/s, decoder layers driven from Python and from the native loop",
        "output tokens/s",
        bars,
    )
    return Experiment(rows, data, plot)


def prepacked_weights(ctx: AblateContext) -> Experiment:
    """With every request of the batch workload running at once, decode steps multiply 33-64
    rows by each weight: too wide for the skinny kernel on the plain weights, and small enough
    that MKL's GEMM spends much of its time re-blocking them. A copy packed once at engine start
    (the native kernel's panels, or oneDNN's format under torch's kernels) removes that work
    from every step. The packed kernel's outputs differ from MKL's in rounding, so the greedy
    outputs may part where two tokens nearly tie."""
    requests = _batch_requests(ctx.sizes)
    results, tokens = {}, {}
    for name, prepack in (("plain", False), ("prepacked", True)):
        results[name], tokens[name] = _greedy_run(
            ctx,
            requests,
            f"batch, all at once ({name} weights)",
            max_num_seqs=len(requests),
            prepack_weights=prepack,
            speculative_method=None,
        )
    match = tokens["plain"] == tokens["prepacked"]
    plain, prepacked = results["plain"], results["prepacked"]
    workload = f"{len(requests)} requests, all at once"
    plot = bar_plot(
        ctx.out_dir / "prepacked_weights.png",
        f"Output tokens/s, {workload}, plain and prepacked float weights",
        "output tokens/s",
        {workload: {name: r.output_tokens_per_s for name, r in results.items()}},
    )
    rows = [
        Comparison(
            "prepacked weights",
            f"output tok/s, {workload}; greedy outputs identical: {_yes_no(match)}",
            "tok/s",
            "plain",
            plain.output_tokens_per_s,
            "prepacked",
            prepacked.output_tokens_per_s,
            higher_is_better=True,
        ),
    ]
    data = {"plain": plain, "prepacked": prepacked, "outputs_match": match}
    return Experiment(rows, data, plot)


def _speculation_run(
    ctx: AblateContext, requests: list[BenchRequest], workload: str, **switches: Any
) -> tuple[ThroughputResult, dict[tuple[int, ...], list[int]]]:
    """`_greedy_run` labelled by the speculative method; the shipped EAGLE head unless the
    switches name a draft model."""
    method = switches["speculative_method"] or "no speculation"
    switches = {"draft_model": None, **switches}
    return _greedy_run(ctx, requests, f"{workload} ({method})", **switches)


def _greedy_run(
    ctx: AblateContext, requests: list[BenchRequest], label: str, **switches: Any
) -> tuple[ThroughputResult, dict[tuple[int, ...], list[int]]]:
    """One greedy pass on a fresh paged-KV engine: its numbers and every request's output
    tokens, keyed by prompt, so two variants' outputs can be compared. The other switches are
    the base's."""
    engine = ctx.engine(kv_cache="paged", **switches)
    finished = FinishedTokens()
    result = run_throughput(engine, requests, label, on_step=finished)
    return result, finished.by_prompt


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"


def _batch_requests(sizes: AblateSizes) -> list[BenchRequest]:
    return random_requests(1, sizes.batch_requests, sizes.batch_prompt_len, sizes.batch_max_tokens)


EXPERIMENTS: dict[str, Callable[[AblateContext], Experiment]] = {
    "kv-cache": kv_cache,
    "batching": batching,
    "prefix-caching": prefix_caching,
    "chunked-prefill": chunked_prefill,
    "kv-memory": kv_memory,
    "speculative": speculative,
    "speculative-batch": speculative_batch,
    "decode-loop": decode_loop,
    "prepacked-weights": prepacked_weights,
}


@dataclass
class AblateReport:
    rows: list[Comparison]
    experiments: dict[str, Experiment]

    def table(self) -> str:
        return comparison_table(self.rows)


def run_ablate(
    base: EngineArgs, sizes: AblateSizes, out_dir: Path, only: list[str] | None = None
) -> AblateReport:
    """Runs the chosen experiments (all by default) and writes the PNGs, ablate.md and
    ablate.json into `out_dir`."""
    names = only or list(EXPERIMENTS)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"only must name experiments from {', '.join(EXPERIMENTS)}: {unknown}")
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = AblateContext(load_model(base.model, parse_dtype(base.dtype)), base, sizes, out_dir)
    experiments = {}
    for name in names:
        print(f"ablate: {name}", file=sys.stderr)
        experiments[name] = EXPERIMENTS[name](ctx)
        gc.collect()  # the previous engines' KV pools
    report = AblateReport([row for e in experiments.values() for row in e.rows], experiments)
    (out_dir / "ablate.md").write_text(report.table() + "\n", encoding="utf-8")
    write_json(
        out_dir / "ablate.json",
        {
            "benchmark": "ablate",
            "engine_args": dataclasses.asdict(base),
            "sizes": dataclasses.asdict(sizes),
            "rows": report.rows,
            "experiments": {
                name: {"data": e.data, "plot": e.plot.name} for name, e in experiments.items()
            },
        },
    )
    return report
