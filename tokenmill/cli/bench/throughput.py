"""`tokenmill bench throughput`: offline throughput and latency of a workload."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tokenmill.bench.workloads import BUILTIN_WORKLOADS
from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.engine.engine import LLMEngine


def add_parser(kinds: argparse._SubParsersAction) -> None:
    throughput = kinds.add_parser("throughput", help="offline throughput and latency")
    throughput.add_argument(
        "--workload",
        default="batch64",
        help=", ".join(BUILTIN_WORKLOADS) + ", or a JSONL file of requests",
    )
    throughput.add_argument("--json", default=None, help="also write the result as JSON here")
    throughput.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default): greedy; above: sampled"
    )
    throughput.add_argument(
        "--seed", type=int, default=None, help="with --temperature: request i uses seed + i"
    )
    throughput.add_argument(
        "--json-schema",
        default=None,
        help="constrain every request to a JSON schema: five_fields (built in) or a schema file",
    )
    add_engine_args(throughput)
    throughput.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.bench.report import write_json
    from tokenmill.bench.structured import load_json_schema
    from tokenmill.bench.throughput import run_throughput
    from tokenmill.bench.workloads import load_workload

    requests = load_workload(ns.workload)
    if ns.json_schema is not None:
        load_json_schema(ns.json_schema)  # a missing file fails before the model loads
    args = engine_args_from(ns)
    engine = LLMEngine(args)
    result = run_throughput(
        engine,
        requests,
        ns.workload,
        temperature=ns.temperature,
        seed=ns.seed,
        json_schema=ns.json_schema,
    )
    engine.close()  # a disk tier keeps the cached blocks for the next run on its directory
    print(result.table())
    if ns.json:
        payload = {"benchmark": "throughput", "engine_args": dataclasses.asdict(args)}
        write_json(Path(ns.json), {**payload, **dataclasses.asdict(result)})
    return 0
