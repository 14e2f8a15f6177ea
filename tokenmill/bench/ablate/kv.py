"""Ablate experiments on the KV cache: none against paged, contiguous against paged memory,
and prefix caching off and on."""

from __future__ import annotations

import random
import statistics
import time

from tokenmill.bench.ablate.context import AblateContext, Experiment, batch_requests, greedy_params
from tokenmill.bench.ablate.observers import SlotOccupancy
from tokenmill.bench.comparison import Comparison
from tokenmill.bench.plots import line_plot
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workloads import BenchRequest, random_token_ids
from tokenmill.config import parse_dtype
from tokenmill.kv.layout import kv_bytes_per_token
from tokenmill.kv.quantized import cache_bytes, kv_head_bytes


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
        engine.add_request("kv", prompt, greedy_params(sizes.kv_new_tokens))
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
    requests = batch_requests(sizes)
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
