"""`tokenmill train-medusa`: train Medusa draft heads on the model's own greedy answers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.engine.engine import LLMEngine


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train-medusa", help="train Medusa draft heads on the model's own answers (CPU)"
    )
    train.add_argument("--out", required=True, help="the .safetensors file to write")
    train.add_argument("--num-prompts", type=int, default=256)
    train.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    train.add_argument("--num-heads", type=int, default=3)
    train.add_argument("--epochs", type=int, default=4)
    train.add_argument("--draft-vocab-size", type=int, default=8192)
    add_engine_args(train)
    train.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.train.medusa import MedusaTrainingConfig, train_medusa

    config = MedusaTrainingConfig(
        num_prompts=ns.num_prompts,
        max_tokens=ns.max_tokens,
        num_heads=ns.num_heads,
        epochs=ns.epochs,
        draft_vocab_size=ns.draft_vocab_size,
    )
    report = train_medusa(LLMEngine(engine_args_from(ns)), Path(ns.out), config)
    accuracy = ", ".join(f"{a:.1%}" for a in report.held_out_accuracy)
    print(
        f"wrote {ns.out}: {report.num_sequences} conversations, {report.num_tokens} tokens "
        f"(generated in {report.generate_s:.0f} s), trained in {report.train_s:.0f} s; "
        f"held-out top-1 accuracy per head {accuracy}",
        file=sys.stderr,
    )
    return 0
