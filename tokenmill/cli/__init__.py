"""The `tokenmill` command line: `main()` (the console script) and the parser it builds from
one module per command, each holding its flags beside its handler."""

from __future__ import annotations

import argparse
import sys

from tokenmill.cli import (
    batch,
    bench,
    cache,
    chat,
    evaluate,
    export_hf,
    generate,
    kv_plan,
    quantize,
    router,
    serve,
    train_corpus,
    train_eagle,
    train_medusa,
)
from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.loader.errors import ModelLoadError

__all__ = ["add_engine_args", "build_parser", "engine_args_from", "main"]

DESCRIPTION = "`tokenmill` command line: generate, chat, serve, bench."

COMMANDS = (
    generate,
    chat,
    serve,
    batch,
    bench,
    kv_plan,
    quantize,
    train_corpus,
    train_eagle,
    train_medusa,
    evaluate,
    export_hf,
    router,
    cache,
)
"""In the order `tokenmill --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ModelLoadError, ValueError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
