"""`tokenmill bench serve`: stream a workload from any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tokenmill.bench.workloads import BUILTIN_WORKLOADS


def add_parser(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser(
        "serve", help="stream a workload from any OpenAI-compatible server; latency percentiles"
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or /v1")
    serve.add_argument(
        "--workload",
        default="batch64",
        help=", ".join(BUILTIN_WORKLOADS) + ", or a JSONL file of requests",
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
    serve.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="send only the workload's first N requests (a quick check)",
    )
    serve.add_argument(
        "--json-schemas",
        type=int,
        default=0,
        metavar="N",
        help="hold request i to the i mod N-th of N distinct JSON schemas, so grammars compile "
        "under load (vLLM's structured_outputs field); 0, the default: unconstrained",
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
        json_schemas=ns.json_schemas,
    )
    requests = load_workload(ns.workload)
    if ns.num_requests is not None:
        if ns.num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {ns.num_requests}")
        requests = requests[: ns.num_requests]  # a prefix: every `after` stays inside it
    result = run_serve(config, requests)
    print(result.table())
    if ns.json:
        payload = {
            "benchmark": "serve",
            "workload": ns.workload,
            "seed": ns.seed,
            "json_schemas": ns.json_schemas,
        }
        write_json(Path(ns.json), {**payload, **dataclasses.asdict(result)})
    return 0 if result.completed else 1
