"""Ablate experiments on speculative decoding: one stream per method, and a big batch with
speculation forced on and under the default policy."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenmill.bench.ablate.context import AblateContext, Experiment, greedy_run, yes_no
from tokenmill.bench.comparison import Comparison
from tokenmill.bench.plots import bar_plot
from tokenmill.bench.throughput import ThroughputResult
from tokenmill.bench.workloads import BenchRequest, load_workload, random_requests

MEDUSA_TREE_SIZE = 8
"""Drafts in a Medusa tree: each costs a row of the verify pass."""


def speculative(ctx: AblateContext) -> Experiment:
    """One stream is bound by reading the weights, so verifying K drafts in one pass costs about
    one token's step and every accepted draft saves a step. Prompt lookup (`ngram`) where the
    output repeats the input; on an open question, the shipped EAGLE head and the target's own
    checkpoint quantized to int4 as a draft model, and the shipped Medusa heads' tree."""
    sizes = ctx.sizes
    int4_copy = {"draft_model": ctx.base.model, "draft_quantization": "int4"}
    cases = (
        ("ngram", "rewrite", "copy a passage", sizes.spec_rewrite_tokens, {}),
        ("eagle", "chat", "an open question", sizes.spec_chat_tokens, {}),
        (
            "medusa",
            "chat",
            "an open question, a tree of the Medusa heads' candidates",
            sizes.spec_chat_tokens,
            {"num_speculative_tokens": MEDUSA_TREE_SIZE},
        ),
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
                f"greedy outputs identical: {yes_no(match)}",
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
            f"greedy outputs identical: {yes_no(match['forced on'])}",
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
            f"greedy outputs identical: {yes_no(match['default policy'])}",
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


def _speculation_run(
    ctx: AblateContext, requests: list[BenchRequest], workload: str, **switches: Any
) -> tuple[ThroughputResult, dict[tuple[int, ...], list[int]]]:
    """`greedy_run` labelled by the speculative method; the shipped EAGLE head unless the
    switches name a draft model."""
    method = switches["speculative_method"] or "no speculation"
    switches = {"draft_model": None, **switches}
    return greedy_run(ctx, requests, f"{workload} ({method})", **switches)
