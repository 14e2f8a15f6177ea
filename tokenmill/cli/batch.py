"""`tokenmill batch`: complete a JSONL file of prompts into a JSONL file, in order, resuming a run
that stopped (tokenmill/cluster/batch_job.py); `--replicas N` runs it on Ray Data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.cli.sampling_args import add_sampling_args, sampling_params_from


def add_parser(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser("batch", help="complete a JSONL file of prompts, resumable")
    batch.add_argument("--input", required=True, type=Path, help="JSONL: `prompt` or `messages`")
    batch.add_argument("--output", required=True, type=Path, help="JSONL, one line per input line")
    batch.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="engines on Ray Data (default: one engine in this process, no Ray)",
    )
    batch.add_argument("--threads-per-replica", type=int, default=1)
    batch.add_argument(
        "--ray-address", default=None, help="join a running Ray ('auto' or HOST:PORT)"
    )
    add_engine_args(batch)
    add_sampling_args(batch)
    batch.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.cluster.batch_job import finished_count, read_lines, run_local

    if ns.replicas is not None and ns.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {ns.replicas}")
    lines = read_lines(ns.input)
    done = finished_count(ns.output)
    remaining = lines[done:]
    print(f"tokenmill: {done} of {len(lines)} lines already done", file=sys.stderr)
    if not remaining:
        return 0
    args, params = engine_args_from(ns), sampling_params_from(ns)
    if ns.replicas is None or (ns.replicas == 1 and ns.ray_address is None):
        from tokenmill.llm import LLM

        run_local(LLM(**vars(args)), remaining, ns.output, params)
        return 0
    from tokenmill.cluster.batch_ray import run_on_ray
    from tokenmill.cluster.launch import ray_session

    cpus = ns.replicas * ns.threads_per_replica + 1  # one for Ray Data's own tasks
    with ray_session(ns.ray_address, cpus):
        run_on_ray(args, remaining, ns.output, params, ns.replicas, ns.threads_per_replica)
    return 0
