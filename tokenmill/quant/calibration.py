"""Calibration and evaluation text that every install already has: CPython's reference topics.

`pydoc_data.topics` is the English text behind `help("class")`, `help("with")`, ...: about 80
pages of the language reference (465k characters, ~110k SmolLM2 tokens on Python 3.11), shipped
with every CPython, so quantizing and evaluating never download anything. Several topics repeat
paragraphs of others ("compound" holds "if", "while", ...), so each paragraph is kept only where
it first appears (topics in sorted order); then every fifth topic is held out for evaluation and
the rest calibrate, and no held-out paragraph was seen by GPTQ, AWQ or SmoothQuant. The text
differs slightly between Python versions; `text_fingerprint` names the exact text a
measurement used.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch

from tokenmill.quant.weight_source import TextEncoder

HELD_OUT_EVERY = 5
PARAGRAPH = "\n\n"
Split = Literal["calibration", "heldout"]
SPLITS: tuple[Split, ...] = ("calibration", "heldout")


def split_paragraphs(split: Split) -> list[str]:
    """The paragraphs of one split's topics, in order, none of them in the other split."""
    from pydoc_data.topics import topics

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    seen: set[str] = set()
    kept: list[list[str]] = []  # per topic that still has a paragraph of its own
    for name in sorted(topics):
        fresh = [p for p in topics[name].split(PARAGRAPH) if p.strip() and p not in seen]
        seen.update(fresh)
        if fresh:
            kept.append(fresh)
    held_out = split == "heldout"
    return [
        p for i, topic in enumerate(kept) if (i % HELD_OUT_EVERY == 0) == held_out for p in topic
    ]


def split_text(split: Split) -> str:
    return PARAGRAPH.join(split_paragraphs(split))


def text_fingerprint(text: str) -> str:
    """A short digest that tells two measurements apart when their Pythons' topics differ."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def token_windows(
    tokenizer: TextEncoder, split: Split, num_samples: int, seq_len: int
) -> torch.Tensor:
    """`[num_samples, seq_len]` token ids: non-overlapping windows spread evenly over the split
    (the same windows on every run), so a few samples still cover many topics."""
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    ids = torch.tensor(tokenizer.encode(split_text(split), add_special_tokens=False))
    available = len(ids) // seq_len
    if num_samples > available:
        raise ValueError(
            f"num_samples={num_samples} windows of seq_len={seq_len} tokens do not fit in the "
            f"{split} text ({len(ids)} tokens, at most {available} windows)"
        )
    windows = ids[: available * seq_len].view(available, seq_len)
    picks = torch.arange(num_samples) * available // num_samples
    return windows[picks].clone()
