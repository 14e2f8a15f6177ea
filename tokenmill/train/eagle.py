"""`tokenmill train-eagle`: fit an EAGLE head to the target's own generations, on the CPU.

1. The target answers the shipped chat prompts (tokenmill/train/prompts.py; most greedily,
   some sampled), so the head learns the distribution it will draft for: the corpus of
   tokenmill/train/corpus.py, generated once and shared with `train-medusa`.
2. One forward pass per conversation gives the target's features at every position.
3. The head learns, from (feature at p, token p + 1), to predict the feature at p + 1
   (smooth-L1) and, through the target's frozen output rows, the target's own distribution
   of token p + 2 over the draft vocabulary (cross-entropy to it, weight 0.1), as in EAGLE.
   Small noise on the input features teaches it to draft from its own slightly wrong
   predictions.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.engine.engine import LLMEngine
from tokenmill.spec.eagle import EagleHead, load_head, output_rows, save_head
from tokenmill.train.corpus import CorpusConfig, build_corpus, corpus_features


@dataclass
class TrainingConfig:
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    draft_vocab_size: int = 8192
    epochs: int = 8
    learning_rate: float = 1e-3
    sequences_per_step: int = 4
    second_draft_weight: float = 0.0  # 0: train the first draft only (`two_draft_forward`)
    init: Path | None = None  # a head to start from, draft vocabulary included; None: fresh
    seed: int = 0


@dataclass
class TrainingReport:
    num_sequences: int
    num_tokens: int
    generate_s: float
    train_s: float
    draft_vocab_coverage: float  # share of the corpus's tokens the head can draft
    held_out_accuracy: float  # head's top-1 = target's next token, with true features
    held_out_second_accuracy: float  # the same for the second draft, from its own prediction


def corpus_in(engine: LLMEngine, config: CorpusConfig, directory: Path | None) -> list[list[int]]:
    """The self-distilled conversations: from (and completed in) `directory`, or generated in
    a temporary one."""
    if directory is not None:
        return build_corpus(engine, config, directory, log=True)
    with tempfile.TemporaryDirectory(prefix="tokenmill-corpus-") as temporary:
        return build_corpus(engine, config, Path(temporary))


def differentiable_forward(
    head: EagleHead, embeds: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """The head's forward over one whole sequence with autograd-friendly ops (the inference
    path writes in place and may run native kernels); tests hold the two equal."""
    x = F.linear(torch.cat([embeds, features], dim=-1), head.fc.weight)
    q, k, v = _attention_inputs(head, x, torch.arange(len(x)))
    return _after_attention(head, x, _attend(head, q, k, v, None))


def two_draft_forward(
    head: EagleHead, embeds: torch.Tensor, features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first drafts (`differentiable_forward`) and the second ones, as drafting makes them:
    at each position r >= 1, the head reads its own prediction of feature r (its first pass
    at r - 1) with token r + 1, and attends to the true-feature positions before r and to
    itself. Training on both teaches the head to draft on from its own predictions."""
    n = len(features)
    x = F.linear(torch.cat([embeds, features], dim=-1), head.fc.weight)
    q, k, v = _attention_inputs(head, x, torch.arange(n))
    first = _after_attention(head, x, _attend(head, q, k, v, None))
    x2 = F.linear(torch.cat([embeds[1:], first[:-1]], dim=-1), head.fc.weight)
    q2, k2, v2 = _attention_inputs(head, x2, torch.arange(1, n))
    # Second draft at position i + 1: the true positions up to i, then itself.
    mask = torch.cat([torch.ones(n - 1, n).tril(), torch.eye(n - 1)], dim=1).bool()
    out = _attend(head, q2, torch.cat([k, k2]), torch.cat([v, v2]), mask)
    return first, _after_attention(head, x2, out)


def _attention_inputs(
    head: EagleHead, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values `[tokens, heads, head_dim]` of the head's layer, rotated."""
    layer, attn = head.layer, head.layer.self_attn
    h = F.rms_norm(x, (head.config.hidden_size,), layer.input_layernorm.weight, head.norm.eps)
    q, k, v = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias).split(
        [attn.q_size, attn.kv_size, attn.kv_size], dim=-1
    )
    q = _rotate(q.view(-1, attn.num_heads, attn.head_dim), positions, attn.rotary)
    k = _rotate(k.view(-1, attn.num_kv_heads, attn.head_dim), positions, attn.rotary)
    return q, k, v.view(-1, attn.num_kv_heads, attn.head_dim)


def _attend(
    head: EagleHead,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention `[queries, hidden]`: causal without a `mask`, else where `mask` allows."""
    attn = head.layer.self_attn
    out = F.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k, v)),
        attn_mask=mask,
        is_causal=mask is None,
        scale=attn.scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).reshape(len(q), -1)


def _after_attention(head: EagleHead, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of the layer after attention, and the head's final norm."""
    layer, attn = head.layer, head.layer.self_attn
    eps, size = head.norm.eps, (head.config.hidden_size,)
    x = x + F.linear(attended, attn.o_proj.weight)
    h = F.rms_norm(x, size, layer.post_attention_layernorm.weight, eps)
    gate, up = F.linear(h, layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
    x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    return F.rms_norm(x, size, head.norm.weight, eps)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def draft_vocabulary(corpus: list[list[int]], size: int, always: set[int]) -> torch.Tensor:
    counts = Counter(token for sequence in corpus for token in sequence)
    ranked = [token for token in always] + [
        token for token, _ in counts.most_common() if token not in always
    ]
    return torch.tensor(ranked[:size], dtype=torch.long)


def train_eagle(
    engine: LLMEngine,
    out: Path,
    config: TrainingConfig,
    corpus_dir: Path | None = None,
    log: bool = False,
) -> TrainingReport:
    """Train on the corpus in `corpus_dir` (generated or completed there first; a temporary
    directory without one) and write the head to `out`; `log` prints each epoch's held-out
    accuracy."""
    torch.manual_seed(config.seed)
    target = engine.loaded.model
    started = time.perf_counter()
    corpus = corpus_in(engine, config.corpus, corpus_dir)
    generate_s = time.perf_counter() - started
    features = corpus_features(target, corpus, corpus_dir, log=corpus_dir is not None)

    if config.init is not None:
        head = load_head(config.init, engine.loaded.config, torch.float32).train()
        vocab = head.draft_vocab.clone()
    else:
        stop = set(engine.tokenizer.stop_token_ids)
        vocab = draft_vocabulary(corpus, config.draft_vocab_size, stop)
        head = EagleHead(engine.loaded.config, len(vocab))
        head.draft_vocab.copy_(vocab)
    rows = output_rows(target, vocab).float()

    held_out = max(1, len(corpus) // 16)
    train_ids = list(range(held_out, len(corpus)))
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=0.0)
    total_steps = config.epochs * -(-len(train_ids) // config.sequences_per_step)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, config.learning_rate, total_steps=total_steps, pct_start=0.1
    )
    rng = random.Random(config.seed)
    train_started = time.perf_counter()
    curve = []
    for epoch in range(config.epochs):
        head.train()
        rng.shuffle(train_ids)
        epoch_loss = 0.0
        for start in range(0, len(train_ids), config.sequences_per_step):
            optimizer.zero_grad()
            for i in train_ids[start : start + config.sequences_per_step]:
                loss = _sequence_loss(
                    head, target, corpus[i], features[i], rows, config.second_draft_weight
                )
                (loss / config.sequences_per_step).backward()
                epoch_loss += float(loss.detach())
            optimizer.step()
            schedule.step()
        head.eval()
        accuracy = held_out_accuracy(
            head, target, corpus[:held_out], features[:held_out], rows, vocab
        )
        curve.append(accuracy)
        if log:
            print(
                f"epoch {epoch + 1}/{config.epochs}: training loss "
                f"{epoch_loss / len(train_ids):.4f}, held-out accuracy of the first draft "
                f"{accuracy[0]:.1%}, of the second {accuracy[1]:.1%} "
                f"({time.perf_counter() - train_started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    train_s = time.perf_counter() - train_started
    counts = Counter(token for sequence in corpus for token in sequence)
    coverage = sum(counts[t] for t in vocab.tolist()) / sum(counts.values())
    save_head(head, out, str(engine.args.model))
    return TrainingReport(
        num_sequences=len(corpus),
        num_tokens=sum(len(s) for s in corpus),
        generate_s=generate_s,
        train_s=train_s,
        draft_vocab_coverage=coverage,
        held_out_accuracy=curve[-1][0] if curve else 0.0,
        held_out_second_accuracy=curve[-1][1] if curve else 0.0,
    )


def _sequence_loss(
    head: EagleHead,
    target: torch.nn.Module,
    token_ids: list[int],
    features: torch.Tensor,
    rows: torch.Tensor,
    second_draft_weight: float,
) -> torch.Tensor:
    """Position p reads (feature p, token p + 1) and predicts feature p + 1, whose logits
    over the draft vocabulary should match the target's at p + 1; with a
    `second_draft_weight`, the second drafts' loss (`two_draft_forward`) is added with it."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    with torch.no_grad():
        embeds = target.embed_tokens(ids[1:]).float()
        target_probs = (features[1:] @ rows.T).softmax(dim=-1)
    noisy = features[:-1] + 0.05 * features.std() * torch.randn_like(features[:-1])
    if not second_draft_weight:
        return _draft_loss(
            differentiable_forward(head, embeds, noisy), features[1:], target_probs, rows
        )
    first, second = two_draft_forward(head, embeds, noisy)
    return _draft_loss(first, features[1:], target_probs, rows) + second_draft_weight * _draft_loss(
        second, features[2:], target_probs[1:], rows
    )


def _draft_loss(
    predicted: torch.Tensor, features: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    feature_loss = F.smooth_l1_loss(predicted, features)
    token_loss = -(target_probs * (predicted @ rows.T).log_softmax(dim=-1)).sum(dim=-1).mean()
    return feature_loss + 0.1 * token_loss


def held_out_accuracy(
    head: EagleHead,
    target: torch.nn.Module,
    corpus: list[list[int]],
    features: list[torch.Tensor],
    rows: torch.Tensor,
    vocab: torch.Tensor,
) -> tuple[float, float]:
    """How often the head's first draft, from true features, and its second, from its own
    predicted feature, are the target's next token (each counted on its own)."""
    hits, total = [0, 0], [0, 0]
    with torch.no_grad():
        for token_ids, feats in zip(corpus, features, strict=True):
            if len(token_ids) < 4:
                continue
            ids = torch.tensor(token_ids, dtype=torch.long)
            first, second = two_draft_forward(
                head, target.embed_tokens(ids[1:]).float(), feats[:-1]
            )
            target_next = target.compute_logits(feats[1:-1]).argmax(dim=-1)
            for k, predicted in enumerate((first[:-1], second[:-1])):
                drafts = vocab[(predicted @ rows.T).argmax(dim=-1)]
                hits[k] += int((drafts == target_next[k:]).sum())
                total[k] += len(drafts)
    return hits[0] / max(total[0], 1), hits[1] / max(total[1], 1)
