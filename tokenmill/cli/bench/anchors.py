"""`tokenmill bench anchors`: the same token ids on HF transformers, vLLM-CPU and llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from


def add_parser(kinds: argparse._SubParsersAction) -> None:
    anchors = kinds.add_parser(
        "anchors", help="the same token ids on HF transformers, vLLM-CPU and llama.cpp"
    )
    anchors.add_argument(
        "--engines",
        default="transformers,vllm,llama.cpp,llama-bench",
        help="comma-separated: transformers, vllm, llama.cpp (llama-server), llama-bench",
    )
    anchors.add_argument("--workloads", default="batch64,single", help="comma-separated")
    anchors.add_argument(
        "--cache-dir", default=None, help="venvs and builds (default ~/.cache/tokenmill/anchors)"
    )
    anchors.add_argument("--threads", type=int, default=2, help="for every engine alike")
    anchors.add_argument(
        "--no-install", action="store_true", help="fail instead of installing a missing engine"
    )
    anchors.add_argument("--hf-batch-size", type=int, default=16, help="transformers batches")
    anchors.add_argument("--llama-slots", type=int, default=16, help="llama-server --parallel")
    anchors.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="ENGINE=PATH",
        help="run an anchor with an interpreter that already has it, not a managed venv",
    )
    anchors.add_argument("--json", default=None, help="also write the results as JSON here")
    anchors.add_argument(
        "--setup-only",
        action="store_true",
        help="install or build the engines and export the model for them, then stop",
    )
    add_engine_args(anchors)
    anchors.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.bench.anchors import AnchorOptions, run_anchors, setup_anchors, write_report
    from tokenmill.bench.venvs import DEFAULT_CACHE_DIR
    from tokenmill.bench.workloads import load_workload

    pythons = {}
    for item in ns.python:
        engine, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--python takes ENGINE=PATH, got {item!r}")
        pythons[engine] = Path(path)
    options = AnchorOptions(
        cache_dir=Path(ns.cache_dir) if ns.cache_dir else DEFAULT_CACHE_DIR,
        threads=ns.threads,
        install=not ns.no_install,
        hf_batch_size=ns.hf_batch_size,
        llama_slots=ns.llama_slots,
        pythons=pythons,
    )
    args = engine_args_from(ns)
    engines = ns.engines.split(",")
    if ns.setup_only:
        for line in setup_anchors(args.model, engines, options):
            print(line)
        return 0
    workloads = {name: load_workload(name) for name in ns.workloads.split(",")}
    report = run_anchors(args, workloads, engines, options)
    print(report.table())
    if ns.json:
        write_report(report, Path(ns.json), args, options)
    return 1 if report.failures() else 0
