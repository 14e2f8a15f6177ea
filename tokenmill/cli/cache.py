"""`tokenmill cache evaluate`: the semantic cache's hit rate on paraphrases and false-hit rate on
near misses at each threshold; `tokenmill cache calibrate`: the threshold meeting a target
false-hit rate, written where `tokenmill serve --semantic-cache-threshold FILE` reads it
(tokenmill/gateway/cache_eval.py)."""

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
    calibrate = actions.add_parser(
        "calibrate", help="the lowest threshold whose false-hit rate meets a target"
    )
    calibrate.add_argument(
        "--target-false-hit-rate",
        type=float,
        default=0.01,
        help="most near misses that may hit, as a fraction (default: 0.01)",
    )
    calibrate.add_argument("--pairs", default=None, help="a JSONL of {a, b, kind} (default: ours)")
    calibrate.add_argument(
        "--guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="calibrate for a cache with the particulars guard on (as served by default)",
    )
    calibrate.add_argument(
        "--out",
        default="semantic-cache-threshold.json",
        help="the file to pass as `tokenmill serve --semantic-cache-threshold`",
    )
    calibrate.set_defaults(func=run_calibrate)


def run_evaluate(ns: argparse.Namespace) -> int:
    from tokenmill.gateway.cache_eval import evaluate_pairs, read_pairs, table
    from tokenmill.gateway.embedding import packaged_embedder

    rows = evaluate_pairs(read_pairs(ns.pairs), packaged_embedder())
    print(table(rows))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0


def run_calibrate(ns: argparse.Namespace) -> int:
    from tokenmill.gateway.cache_eval import calibrate, read_pairs
    from tokenmill.gateway.embedding import packaged_embedder

    result = calibrate(
        read_pairs(ns.pairs), packaged_embedder(), ns.target_false_hit_rate, ns.guard
    )
    Path(ns.out).write_text(json.dumps(result, indent=1))
    print(
        f"threshold {result['threshold']:.3f} (guard {'on' if result['guard'] else 'off'}), "
        f"target false-hit rate {result['target_false_hit_rate']:.1%}\n"
        f"  on all pairs:        hit rate {result['hit_rate']:.1%}, "
        f"false-hit rate {result['false_hit_rate']:.1%} "
        f"({result['num_paraphrases']} paraphrases, {result['num_near_misses']} near misses)\n"
        f"  held out ({result['folds']}-fold): hit rate {result['held_out_hit_rate']:.1%}, "
        f"false-hit rate {result['held_out_false_hit_rate']:.1%}\n"
        f"wrote {ns.out}: serve with --semantic-cache --semantic-cache-threshold {ns.out}"
    )
    return 0
