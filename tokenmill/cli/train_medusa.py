"""`tokenmill train-medusa`: train Medusa draft heads on the model's own answers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.cli.train_corpus import add_corpus_args, corpus_config_from
from tokenmill.engine.engine import LLMEngine


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train-medusa", help="train Medusa draft heads on the model's own answers (CPU)"
    )
    train.add_argument("--out", required=True, help="the .safetensors file to write")
    add_corpus_args(train, default_prompts=1024)
    train.add_argument("--num-heads", type=int, default=3)
    train.add_argument("--epochs", type=int, default=4)
    train.add_argument("--draft-vocab-size", type=int, default=8192)
    add_engine_args(train)
    train.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.train.medusa import MedusaTrainingConfig, train_medusa

    config = MedusaTrainingConfig(
        corpus=corpus_config_from(ns),
        num_heads=ns.num_heads,
        epochs=ns.epochs,
        draft_vocab_size=ns.draft_vocab_size,
    )
    corpus = Path(ns.corpus) if ns.corpus else None
    report = train_medusa(LLMEngine(engine_args_from(ns)), Path(ns.out), config, corpus, log=True)
    accuracy = ", ".join(f"{a:.1%}" for a in report.held_out_accuracy)
    print(
        f"wrote {ns.out}: {report.num_sequences} conversations, {report.num_tokens} tokens "
        f"(generated in {report.generate_s:.0f} s), trained in {report.train_s:.0f} s; "
        f"held-out top-1 accuracy per head {accuracy}",
        file=sys.stderr,
    )
    return 0
