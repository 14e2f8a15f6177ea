"""`tokenmill train-corpus`: generate (or finish) the self-distilled corpus the head trainers
read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.engine.engine import LLMEngine


def add_corpus_args(parser: argparse.ArgumentParser, default_prompts: int) -> None:
    """The corpus flags `train-corpus`, `train-eagle` and `train-medusa` share."""
    parser.add_argument(
        "--corpus",
        default=None,
        help="directory of the generated conversations: reused and resumed if it exists",
    )
    parser.add_argument("--num-prompts", type=int, default=default_prompts)
    parser.add_argument("--max-tokens", type=int, default=160, help="answer length per prompt")


def corpus_config_from(ns: argparse.Namespace):
    from tokenmill.train.corpus import CorpusConfig

    return CorpusConfig(num_prompts=ns.num_prompts, max_tokens=ns.max_tokens)


def add_parser(commands: argparse._SubParsersAction) -> None:
    corpus = commands.add_parser(
        "train-corpus",
        help="generate the model's own answers to the training prompts, for train-eagle/medusa",
    )
    add_corpus_args(corpus, default_prompts=2048)
    add_engine_args(corpus)
    corpus.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.train.corpus import build_corpus

    if ns.corpus is None:
        raise ValueError("train-corpus needs --corpus DIR, the directory to write")
    engine = LLMEngine(engine_args_from(ns))
    conversations = build_corpus(engine, corpus_config_from(ns), Path(ns.corpus), log=True)
    print(
        f"{ns.corpus}: {len(conversations)} conversations, "
        f"{sum(len(c) for c in conversations)} tokens",
        file=sys.stderr,
    )
    return 0
