"""`tokenmill bench ablate`: each technique off and on, one table, PNG plots and JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from


def add_parser(kinds: argparse._SubParsersAction) -> None:
    ablate = kinds.add_parser(
        "ablate", help="each technique off and on: one table, PNG plots and JSON"
    )
    ablate.add_argument("--out-dir", default="bench_out/ablate")
    ablate.add_argument(
        "--quick", action="store_true", help="tiny sizes: seconds instead of ~15 minutes"
    )
    ablate.add_argument(
        "--only",
        default=None,
        help="comma-separated: kv-cache,batching,prefix-caching,chunked-prefill,kv-memory,"
        "speculative,speculative-batch,decode-loop,prepacked-weights",
    )
    add_engine_args(ablate)
    ablate.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.bench.ablate import FULL, QUICK, run_ablate

    only = ns.only.split(",") if ns.only else None
    report = run_ablate(engine_args_from(ns), QUICK if ns.quick else FULL, Path(ns.out_dir), only)
    print(report.table())
    print(f"wrote ablate.md, ablate.json and the plots to {ns.out_dir}", file=sys.stderr)
    return 0
