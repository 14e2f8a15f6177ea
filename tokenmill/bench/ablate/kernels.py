"""Ablate experiments on the kernels: the decode loop driven from Python or from C++, and the
float weights plain or prepacked."""

from __future__ import annotations

import random
from typing import Any

from tokenmill.bench.ablate.context import (
    AblateContext,
    Experiment,
    batch_requests,
    greedy_run,
    yes_no,
)
from tokenmill.bench.comparison import Comparison
from tokenmill.bench.plots import bar_plot
from tokenmill.bench.workloads import BenchRequest, random_requests, random_token_ids


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
            results[loop], tokens[loop] = greedy_run(
                ctx, requests, f"{name} ({loop} loop)", decode_loop=loop, speculative_method=None
            )
        match = tokens["python"] == tokens["native"]
        python, native = results["python"], results["native"]
        bars[name] = {loop: r.output_tokens_per_s for loop, r in results.items()}
        data[name] = {"python": python, "native": native, "outputs_match": match}
        rows += [
            Comparison(
                "native decode loop",
                f"output tok/s, {workload}; greedy outputs identical: {yes_no(match)}",
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
    requests = batch_requests(ctx.sizes)
    results, tokens = {}, {}
    for name, prepack in (("plain", False), ("prepacked", True)):
        results[name], tokens[name] = greedy_run(
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
            f"output tok/s, {workload}; greedy outputs identical: {yes_no(match)}",
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
