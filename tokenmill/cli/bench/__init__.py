"""`tokenmill bench`: the command group; each kind of benchmark is a module of its own."""

from __future__ import annotations

import argparse

from tokenmill.cli.bench import ablate, anchors, roofline, serve, throughput

BENCH_COMMANDS = (throughput, serve, ablate, anchors, roofline)
"""In the order `tokenmill bench --help` lists them."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure tokenmill on a workload")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for command in BENCH_COMMANDS:
        command.add_parser(kinds)
