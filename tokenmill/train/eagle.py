"""`tokenmill train-eagle`: fit an EAGLE head to the target's own generations, on the CPU.

1. The target answers a few hundred chat prompts (half greedy, half sampled), so the head
   learns the distribution it will draft for.
2. One forward pass per conversation gives the target's features at every position.
3. The head learns, from (feature at p, token p + 1), to predict the feature at p + 1
   (smooth-L1) and, through the target's frozen output rows, the target's own distribution
   of token p + 2 over the draft vocabulary (cross-entropy to it, weight 0.1), as in EAGLE.
   Small noise on the input features teaches it to draft from its own slightly wrong
   predictions.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.engine.engine import LLMEngine
from tokenmill.model.attention import AttentionMetadata
from tokenmill.sampling.params import SamplingParams
from tokenmill.spec.eagle import EagleHead, output_rows, save_head

TOPICS = [
    "the water cycle",
    "photosynthesis",
    "volcanoes",
    "the moon",
    "black holes",
    "bees",
    "the Roman Empire",
    "the printing press",
    "electric cars",
    "solar panels",
    "vaccines",
    "the human heart",
    "sleep",
    "coffee",
    "bread baking",
    "chess",
    "the guitar",
    "jazz",
    "the stock market",
    "inflation",
    "recycling",
    "rainforests",
    "deserts",
    "glaciers",
    "earthquakes",
    "the internet",
    "email",
    "passwords",
    "machine learning",
    "databases",
    "Python lists",
    "sorting algorithms",
    "binary numbers",
    "prime numbers",
    "fractions",
    "gravity",
    "magnets",
    "rainbows",
    "thunderstorms",
    "tides",
    "dinosaurs",
    "whales",
    "octopuses",
    "cats",
    "dogs",
    "gardening",
    "composting",
    "running",
    "yoga",
    "meditation",
    "public speaking",
    "job interviews",
    "budgeting",
    "learning a language",
    "time zones",
    "maps",
    "bicycles",
    "trains",
    "airplanes",
    "bridges",
    "castles",
    "museums",
    "libraries",
]
TEMPLATES = [
    "Explain {} to a ten-year-old.",
    "What are three interesting facts about {}?",
    "Write a short paragraph about {}.",
    "Give me some tips related to {}.",
    "What is the history of {}?",
    "Why is {} important?",
    "Write a short poem about {}.",
    "What are the pros and cons of {}?",
]


def training_prompts(count: int, seed: int) -> list[str]:
    """Every topic-template pair once, in a seeded order, then the same order again as often as
    `count` asks: each repeat is answered by sampling (`answer_temperature`), so it adds a new
    conversation rather than a copy."""
    pairs = [template.format(topic) for topic in TOPICS for template in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(count)]


def answer_temperature(index: int) -> float:
    """Greedy for every other prompt of the first pass, which is what greedy users see; sampled
    for the rest, and for every repeat, whose seed (its index) differs from the first time."""
    first_pass = index < len(TOPICS) * len(TEMPLATES)
    return 0.0 if first_pass and index % 2 == 0 else 0.7


@dataclass
class TrainingConfig:
    num_prompts: int = 320
    max_tokens: int = 160
    draft_vocab_size: int = 8192
    epochs: int = 8
    learning_rate: float = 1e-3
    sequences_per_step: int = 4
    seed: int = 0


@dataclass
class TrainingReport:
    num_sequences: int
    num_tokens: int
    generate_s: float
    train_s: float
    draft_vocab_coverage: float  # share of the corpus's tokens the head can draft
    held_out_accuracy: float  # head's top-1 = target's next token, with true features


def generate_corpus(engine: LLMEngine, config: TrainingConfig) -> list[list[int]]:
    """Prompt and answer token ids of every conversation."""
    tokenizer = engine.tokenizer
    for index, prompt in enumerate(training_prompts(config.num_prompts, config.seed)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(
            temperature=answer_temperature(index), max_tokens=config.max_tokens, seed=index
        )
        engine.add_request(f"eagle-{index}", ids, params)
    corpus: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                corpus[output.request_id] = [*output.prompt_token_ids, *output.outputs[0].token_ids]
    return [corpus[key] for key in sorted(corpus)]


def target_features(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """The target's final hidden state at every position of one sequence."""
    meta = AttentionMetadata.build([len(token_ids)], [len(token_ids)], None, 16, None)
    with torch.inference_mode():
        ids = torch.tensor(token_ids, dtype=torch.long)
        hidden = model(ids, torch.arange(len(token_ids)), None, meta)
    return hidden.float().clone()  # outside inference mode: a tensor autograd may save


def differentiable_forward(
    head: EagleHead, embeds: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """The head's forward over one whole sequence with autograd-friendly ops (the inference
    path writes in place and may run native kernels); tests hold the two equal."""
    layer, attn = head.layer, head.layer.self_attn
    eps, size = head.norm.eps, (head.config.hidden_size,)
    x = F.linear(torch.cat([embeds, features], dim=-1), head.fc.weight)
    h = F.rms_norm(x, size, layer.input_layernorm.weight, eps)
    q, k, v = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias).split(
        [attn.q_size, attn.kv_size, attn.kv_size], dim=-1
    )
    positions = torch.arange(len(x))
    q = _rotate(q.view(-1, attn.num_heads, attn.head_dim), positions, attn.rotary)
    k = _rotate(k.view(-1, attn.num_kv_heads, attn.head_dim), positions, attn.rotary)
    v = v.view(-1, attn.num_kv_heads, attn.head_dim)
    out = F.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=attn.scale, enable_gqa=True
    )
    x = x + F.linear(out.transpose(0, 1).reshape(len(x), -1), attn.o_proj.weight)
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


def load_or_generate_corpus(
    engine: LLMEngine, config: TrainingConfig, cache: Path | None
) -> list[list[int]]:
    """The conversations from `cache` when it exists (generating them is most of the time),
    else freshly generated and, with a `cache` path, saved there."""
    if cache is not None and cache.is_file():
        return json.loads(cache.read_text(encoding="utf-8"))
    corpus = generate_corpus(engine, config)
    if cache is not None:
        cache.write_text(json.dumps(corpus), encoding="utf-8")
    return corpus


def train_eagle(
    engine: LLMEngine, out: Path, config: TrainingConfig, corpus_cache: Path | None = None
) -> TrainingReport:
    torch.manual_seed(config.seed)
    target = engine.loaded.model
    started = time.perf_counter()
    corpus = load_or_generate_corpus(engine, config, corpus_cache)
    generate_s = time.perf_counter() - started
    features = [target_features(target, sequence) for sequence in corpus]

    vocab = draft_vocabulary(corpus, config.draft_vocab_size, set(engine.tokenizer.stop_token_ids))
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
    head.train()
    for _ in range(config.epochs):
        rng.shuffle(train_ids)
        for start in range(0, len(train_ids), config.sequences_per_step):
            optimizer.zero_grad()
            for i in train_ids[start : start + config.sequences_per_step]:
                loss = _sequence_loss(head, target, corpus[i], features[i], rows)
                (loss / config.sequences_per_step).backward()
            optimizer.step()
            schedule.step()
    head.eval()
    train_s = time.perf_counter() - train_started
    counts = Counter(token for sequence in corpus for token in sequence)
    coverage = sum(counts[t] for t in vocab.tolist()) / sum(counts.values())
    accuracy = _held_out_accuracy(head, target, corpus[:held_out], features[:held_out], rows, vocab)
    save_head(head, out, str(engine.args.model))
    return TrainingReport(
        num_sequences=len(corpus),
        num_tokens=sum(len(s) for s in corpus),
        generate_s=generate_s,
        train_s=train_s,
        draft_vocab_coverage=coverage,
        held_out_accuracy=accuracy,
    )


def _sequence_loss(
    head: EagleHead,
    target: torch.nn.Module,
    token_ids: list[int],
    features: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """Position p reads (feature p, token p + 1) and predicts feature p + 1, whose logits
    over the draft vocabulary should match the target's at p + 1."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    with torch.no_grad():
        embeds = target.embed_tokens(ids[1:]).float()
        target_probs = (features[1:] @ rows.T).softmax(dim=-1)
    noise = 0.05 * features.std() * torch.randn_like(features[:-1])
    predicted = differentiable_forward(head, embeds, features[:-1] + noise)
    feature_loss = F.smooth_l1_loss(predicted, features[1:])
    token_loss = -(target_probs * (predicted @ rows.T).log_softmax(dim=-1)).sum(dim=-1).mean()
    return feature_loss + 0.1 * token_loss


def _held_out_accuracy(
    head: EagleHead,
    target: torch.nn.Module,
    corpus: list[list[int]],
    features: list[torch.Tensor],
    rows: torch.Tensor,
    vocab: torch.Tensor,
) -> float:
    hits = total = 0
    with torch.no_grad():
        for token_ids, feats in zip(corpus, features, strict=True):
            ids = torch.tensor(token_ids, dtype=torch.long)
            predicted = differentiable_forward(
                head, target.embed_tokens(ids[1:]).float(), feats[:-1]
            )
            drafts = vocab[(predicted[:-1] @ rows.T).argmax(dim=-1)]
            target_next = target.compute_logits(feats[1:-1]).argmax(dim=-1)
            hits += int((drafts == target_next).sum())
            total += len(drafts)
    return hits / max(total, 1)
