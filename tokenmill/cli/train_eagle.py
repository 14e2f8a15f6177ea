"""`tokenmill train-eagle`: train an EAGLE draft head on the model's own answers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.engine.engine import LLMEngine


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train-eagle", help="train an EAGLE draft head on the model's own answers (CPU)"
    )
    train.add_argument("--out", required=True, help="the .safetensors file to write")
    train.add_argument("--num-prompts", type=int, default=320)
    train.add_argument("--max-tokens", type=int, default=160, help="answer length per prompt")
    train.add_argument("--epochs", type=int, default=8)
    train.add_argument("--draft-vocab-size", type=int, default=8192)
    train.add_argument(
        "--corpus", default=None, help="JSON of generated conversations: reused if it exists"
    )
    add_engine_args(train)
    train.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.train.eagle import TrainingConfig, train_eagle

    config = TrainingConfig(
        num_prompts=ns.num_prompts,
        max_tokens=ns.max_tokens,
        draft_vocab_size=ns.draft_vocab_size,
        epochs=ns.epochs,
    )
    corpus = Path(ns.corpus) if ns.corpus else None
    report = train_eagle(LLMEngine(engine_args_from(ns)), Path(ns.out), config, corpus)
    print(
        f"wrote {ns.out}: {report.num_sequences} conversations, {report.num_tokens} tokens "
        f"(generated in {report.generate_s:.0f} s), trained in {report.train_s:.0f} s; draft "
        f"vocabulary covers {report.draft_vocab_coverage:.1%} of the tokens; held-out "
        f"first-draft accuracy {report.held_out_accuracy:.1%}",
        file=sys.stderr,
    )
    return 0
