"""`tokenmill train-eagle`: train an EAGLE draft head on the model's own answers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.cli.train_corpus import add_corpus_args, corpus_config_from
from tokenmill.engine.engine import LLMEngine


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train-eagle", help="train an EAGLE draft head on the model's own answers (CPU)"
    )
    train.add_argument("--out", required=True, help="the .safetensors file to write")
    add_corpus_args(train, default_prompts=1024)
    train.add_argument("--epochs", type=int, default=8)
    train.add_argument("--draft-vocab-size", type=int, default=8192)
    train.add_argument(
        "--second-draft-weight",
        type=float,
        default=0.0,
        help="also train the second draft, from the head's own prediction, with this loss "
        "weight (0: the first draft only)",
    )
    train.add_argument("--learning-rate", type=float, default=1e-3, help="the one-cycle peak")
    train.add_argument(
        "--init",
        default=None,
        help="an EAGLE head to continue training (its draft vocabulary is kept); "
        "default: a fresh head",
    )
    add_engine_args(train)
    train.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.train.eagle import TrainingConfig, train_eagle

    config = TrainingConfig(
        corpus=corpus_config_from(ns),
        draft_vocab_size=ns.draft_vocab_size,
        epochs=ns.epochs,
        second_draft_weight=ns.second_draft_weight,
        init=Path(ns.init) if ns.init else None,
        learning_rate=ns.learning_rate,
    )
    corpus = Path(ns.corpus) if ns.corpus else None
    report = train_eagle(LLMEngine(engine_args_from(ns)), Path(ns.out), config, corpus, log=True)
    print(
        f"wrote {ns.out}: {report.num_sequences} conversations, {report.num_tokens} tokens "
        f"(generated in {report.generate_s:.0f} s), trained in {report.train_s:.0f} s; draft "
        f"vocabulary covers {report.draft_vocab_coverage:.1%} of the tokens; held-out "
        f"first-draft accuracy {report.held_out_accuracy:.1%}, second-draft "
        f"{report.held_out_second_accuracy:.1%}",
        file=sys.stderr,
    )
    return 0
