"""`tokenmill bench serve`: stream a workload from any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def add_parser(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser(
        "serve", help="stream a workload from any OpenAI-compatible server; latency percentiles"
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or /v1")
    serve.add_argument(
        "--workload",
        default="batch64",
        help="batch64, single, rewrite, chat, sessions, long8, or a JSONL file of requests",
    )
    serve.add_argument(
        "--model",
        dest="served_model",
        default=None,
        help="model name to send (default: the first the server lists)",
    )
    serve.add_argument(
        "--request-rate", default="inf", help="requests/s as a Poisson process, or inf"
    )
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    serve.add_argument(
        "--goodput", default=None, help="SLOs such as ttft_ms=500,tpot_ms=50 (also e2el_ms)"
    )
    serve.add_argument("--json", default=None, help="also write the result as JSON here")
    serve.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.bench.report import write_json
    from tokenmill.bench.serve import ServeConfig, parse_goodput, parse_request_rate, run_serve
    from tokenmill.bench.workloads import load_workload

    config = ServeConfig(
        base_url=ns.base_url,
        model=ns.served_model,
        request_rate=parse_request_rate(ns.request_rate),
        max_concurrency=ns.max_concurrency,
        seed=ns.seed,
        goodput=parse_goodput(ns.goodput) if ns.goodput else {},
    )
    result = run_serve(config, load_workload(ns.workload))
    print(result.table())
    if ns.json:
        payload = {"benchmark": "serve", "workload": ns.workload, "seed": ns.seed}
        write_json(Path(ns.json), {**payload, **dataclasses.asdict(result)})
    return 0 if result.completed else 1
