"""`tokenmill cache evaluate`: the semantic cache's hit rate on paraphrases and false-hit rate on
near misses at each threshold (tokenmill/gateway/cache_eval.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    cache = commands.add_parser("cache", help="evaluate the semantic response cache")
    actions = cache.add_subparsers(dest="cache_command", required=True)
    evaluate = actions.add_parser(
        "evaluate", help="hit and false-hit rates per threshold on paraphrase / near-miss pairs"
    )
    evaluate.add_argument("--pairs", default=None, help="a JSONL of {a, b, kind} (default: ours)")
    evaluate.add_argument("--json", default=None, help="also write the rows here")
    evaluate.set_defaults(func=run_evaluate)


def run_evaluate(ns: argparse.Namespace) -> int:
    from tokenmill.gateway.cache_eval import evaluate_pairs, read_pairs, table
    from tokenmill.gateway.embedding import packaged_embedder

    rows = evaluate_pairs(read_pairs(ns.pairs), packaged_embedder())
    print(table(rows))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0
