"""Ablate experiments on scheduling: static against continuous batching, and chunked prefill
off and on."""

from __future__ import annotations

import itertools
import random
import time
from collections import defaultdict

from tokenmill.bench.ablate.context import AblateContext, Experiment, batch_requests, greedy_params
from tokenmill.bench.ablate.observers import FinishTimes
from tokenmill.bench.comparison import Comparison
from tokenmill.bench.plots import line_plot
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workloads import random_token_ids


def batching(ctx: AblateContext) -> Experiment:
    """A static batch runs until its longest request ends; continuous batching refills each
    freed slot at the next step. Both hold at most `batch_max_num_seqs` requests at once."""
    sizes = ctx.sizes
    requests = batch_requests(sizes)
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
            engine.add_request(f"decode-{index}", prompt, greedy_params(sizes.chunk_decode_tokens))
        token_times: dict[str, list[float]] = defaultdict(list)
        arrival = first_token = None
        steps = 0
        while engine.has_unfinished_requests():
            if steps == sizes.chunk_warm_steps:
                engine.add_request("long", long_prompt, greedy_params(1))
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
