"""How often the semantic cache is right: on pairs that should hit (paraphrases) and pairs
that must not (other numbers, negations, swapped or other entities), the hit rate and the false
hit rate at each threshold, with and without the particulars guard. The pairs ship in
tokenmill/gateway/data/cache_pairs.jsonl."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

import numpy as np

from tokenmill.gateway.embedding import TextEmbedder
from tokenmill.gateway.semantic_cache import normalise, same_particulars

PAIRS = files("tokenmill.gateway") / "data" / "cache_pairs.jsonl"
THRESHOLDS = (0.8, 0.85, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98)


def read_pairs(path: str | Path | None = None) -> list[dict]:
    text = Path(path).read_text() if path else PAIRS.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def evaluate_pairs(
    pairs: Sequence[dict], embedder: TextEmbedder, thresholds: Sequence[float] = THRESHOLDS
) -> list[dict]:
    """One row per (threshold, guard): hit rate on paraphrases, false-hit rate on the rest."""
    a = [normalise(p["a"]) for p in pairs]
    b = [normalise(p["b"]) for p in pairs]
    similarity = np.sum(embedder.embed(a) * embedder.embed(b), axis=1)
    same = np.array([x == y for x, y in zip(a, b, strict=True)])
    guard = np.array([same_particulars(x, y) for x, y in zip(a, b, strict=True)])
    should = np.array([p["kind"] == "paraphrase" for p in pairs])
    rows = []
    for threshold in thresholds:
        for guarded in (False, True):
            hit = same | ((similarity >= threshold) & (guard if guarded else True))
            rows.append(
                {
                    "threshold": threshold,
                    "guard": guarded,
                    "hit_rate": float(hit[should].mean()),
                    "false_hit_rate": float(hit[~should].mean()),
                    "num_paraphrases": int(should.sum()),
                    "num_near_misses": int((~should).sum()),
                }
            )
    return rows


def table(rows: Sequence[dict]) -> str:
    lines = ["threshold  guard  hit rate  false-hit rate", "-" * 42]
    for r in rows:
        lines.append(
            f"{r['threshold']:>9.2f}  {'on' if r['guard'] else 'off':>5}  {r['hit_rate']:>8.1%}"
            f"  {r['false_hit_rate']:>14.1%}"
        )
    return "\n".join(lines)
