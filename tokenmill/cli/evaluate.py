"""`tokenmill eval`: each quantization's quality, bytes and speed against the unquantized
model, one table (the driver is tokenmill/bench/evaluate.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.config import KV_CACHE_DTYPES, EngineArgs
from tokenmill.quant.registry import quantization_choices


def add_parser(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval", help="perplexity, KL, bytes and tokens/s of each quantization, one table"
    )
    evaluate.add_argument(
        "--model",
        default=EngineArgs.model,
        help="the unquantized model every row is compared against",
    )
    evaluate.add_argument(
        "--quantization",
        nargs="+",
        choices=quantization_choices(),
        default=None,
        help="methods to compare (default: all that apply, none with --kv-cache-dtype alone); "
        "the unquantized model is row one",
    )
    evaluate.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=[d for d in KV_CACHE_DTYPES if d != "auto"],
        default=[],
        help="also rows for these quantized KV caches, on the unquantized weights",
    )
    evaluate.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="also a directory `tokenmill quantize` wrote (repeatable)",
    )
    evaluate.add_argument("--eval-samples", type=int, default=32, help="held-out windows")
    evaluate.add_argument("--eval-seq-len", type=int, default=256, help="tokens per window")
    evaluate.add_argument("--no-speed", action="store_true", help="skip the tokens/s runs")
    evaluate.add_argument("--json", default=None, help="also write the report as JSON here")
    evaluate.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.bench.evaluate import SPEED_WORKLOADS, default_methods, evaluate

    # Asked about KV dtypes alone, compare just those with the baseline.
    methods = ns.quantization or ([] if ns.kv_cache_dtype else default_methods(ns.model))
    report = evaluate(
        ns.model,
        methods,
        ns.checkpoint,
        ns.eval_samples,
        ns.eval_seq_len,
        () if ns.no_speed else SPEED_WORKLOADS,
        on_row=lambda row: print(f"eval: {row.name} done", file=sys.stderr),
        kv_cache_dtypes=tuple(ns.kv_cache_dtype),
    )
    print(report.table())
    if ns.json:
        report.write_json(Path(ns.json))
    return 0
