"""`tokenmill train-medusa`: fit Medusa heads to the target's own answers, on the CPU.

1. The target answers the shipped chat prompts (tokenmill/train/prompts.py), in large batches
   through the engine: self-distillation, the heads learn what the target itself will say.
   The corpus (tokenmill/train/corpus.py) is the one `train-eagle` reads; the heads' labels
   are the target's own distributions, so its sampled answers serve as well as greedy ones.
2. One forward pass per conversation gives the target's final hidden state at every position.
3. Head k (from 0) learns, from the hidden state at position p, the target's own distribution
   of the token at p + 2 + k (its logits at p + 1 + k) over the draft vocabulary: a soft
   cross-entropy through the target's frozen output rows, as Medusa-2's self-distillation.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.engine.engine import LLMEngine
from tokenmill.spec.eagle import output_rows
from tokenmill.spec.medusa import MedusaHeads, save_medusa_heads
from tokenmill.train.corpus import CorpusConfig, corpus_features
from tokenmill.train.eagle import corpus_in, draft_vocabulary


@dataclass
class MedusaTrainingConfig:
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    num_heads: int = 3
    draft_vocab_size: int = 8192
    epochs: int = 4
    learning_rate: float = 1e-3
    positions_per_step: int = 2048
    seed: int = 0


@dataclass
class MedusaTrainingReport:
    num_sequences: int
    num_tokens: int
    generate_s: float
    train_s: float
    held_out_accuracy: list[float]  # per head: top-1 equals the target's own token


def head_examples(
    features: list[torch.Tensor], num_heads: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Inputs (hidden state at p) and, per head k, the target's hidden state at p + 1 + k whose
    logits are that head's soft label: positions with every head's label inside the sequence."""
    inputs, labels = [], [[] for _ in range(num_heads)]
    for feats in features:
        usable = len(feats) - 1 - num_heads
        if usable <= 0:
            continue
        inputs.append(feats[:usable])
        for k in range(num_heads):
            labels[k].append(feats[1 + k : 1 + k + usable])
    return torch.cat(inputs), [torch.cat(label) for label in labels]


def train_medusa(
    engine: LLMEngine,
    out: Path,
    config: MedusaTrainingConfig,
    corpus_dir: Path | None = None,
    log: bool = False,
) -> MedusaTrainingReport:
    """Train on the corpus in `corpus_dir` (generated or completed there first; a temporary
    directory without one) and write the heads to `out`; `log` prints each epoch's held-out
    accuracy per head."""
    torch.manual_seed(config.seed)
    target = engine.loaded.model
    started = time.perf_counter()
    corpus = corpus_in(engine, config.corpus, corpus_dir)
    generate_s = time.perf_counter() - started
    features = corpus_features(target, corpus, corpus_dir, log=corpus_dir is not None)
    vocab = draft_vocabulary(corpus, config.draft_vocab_size, set(engine.tokenizer.stop_token_ids))
    rows = output_rows(target, vocab).float()
    heads = MedusaHeads(engine.loaded.config.hidden_size, config.num_heads, len(vocab))
    heads.draft_vocab.copy_(vocab)

    held_out = max(1, len(corpus) // 16)
    train_inputs, train_labels = head_examples(features[held_out:], config.num_heads)
    test_inputs, test_labels = head_examples(features[:held_out], config.num_heads)
    with torch.no_grad():  # the target's own tokens, each held-out label's argmax
        test_tokens = [(label @ rows.T).argmax(dim=-1) for label in test_labels]
    del test_labels
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.learning_rate, weight_decay=0.0)
    steps_per_epoch = -(-len(train_inputs) // config.positions_per_step)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, config.learning_rate, total_steps=config.epochs * steps_per_epoch, pct_start=0.1
    )
    rng = random.Random(config.seed)
    train_started = time.perf_counter()
    accuracy: list[float] = []
    for epoch in range(config.epochs):
        heads.train()
        order = list(range(len(train_inputs)))
        rng.shuffle(order)
        epoch_loss, num_steps = 0.0, 0
        for start in range(0, len(order), config.positions_per_step):
            batch = torch.tensor(order[start : start + config.positions_per_step])
            optimizer.zero_grad()
            loss = _soft_cross_entropy(
                heads, train_inputs[batch], [t[batch] for t in train_labels], rows
            )
            loss.backward()
            optimizer.step()
            schedule.step()
            epoch_loss, num_steps = epoch_loss + float(loss.detach()), num_steps + 1
        heads.eval()
        if log or epoch + 1 == config.epochs:
            accuracy = _held_out_accuracy(heads, test_inputs, test_tokens, rows)
        if log:
            per_head = ", ".join(f"{a:.1%}" for a in accuracy)
            print(
                f"epoch {epoch + 1}/{config.epochs}: training loss {epoch_loss / num_steps:.4f}, "
                f"held-out top-1 accuracy per head {per_head} "
                f"({time.perf_counter() - train_started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    train_s = time.perf_counter() - train_started
    save_medusa_heads(heads, out, str(engine.args.model))
    return MedusaTrainingReport(
        num_sequences=len(corpus),
        num_tokens=sum(len(s) for s in corpus),
        generate_s=generate_s,
        train_s=train_s,
        held_out_accuracy=accuracy,
    )


def _soft_cross_entropy(
    heads: MedusaHeads, inputs: torch.Tensor, labels: list[torch.Tensor], rows: torch.Tensor
) -> torch.Tensor:
    """Mean over heads of the cross-entropy to the target's distribution at each label."""
    predicted = heads(inputs) @ rows.T  # [num_heads, batch, draft_vocab]
    loss = predicted.new_zeros(())
    for k, label in enumerate(labels):
        with torch.no_grad():
            target_probs = (label @ rows.T).softmax(dim=-1)
        loss = loss - (target_probs * predicted[k].log_softmax(dim=-1)).sum(dim=-1).mean()
    return loss / len(labels)


def _held_out_accuracy(
    heads: MedusaHeads, inputs: torch.Tensor, tokens: list[torch.Tensor], rows: torch.Tensor
) -> list[float]:
    """Per head, how often its top draft-vocabulary column is the target's own (`tokens`)."""
    with torch.no_grad():
        predicted = (heads(inputs) @ rows.T).argmax(dim=-1)
        return [float((predicted[k] == token).float().mean()) for k, token in enumerate(tokens)]
