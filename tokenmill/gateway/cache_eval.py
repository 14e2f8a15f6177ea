"""How often the semantic cache is right: on pairs that should hit (paraphrases) and pairs
that must not (other numbers, negations, swapped or other entities), the hit rate and the false
hit rate at each threshold, with and without the particulars guard; and the threshold
calibrated to a target false-hit rate, with its rates on pairs it was not chosen on. The pairs
ship in tokenmill/gateway/data/cache_pairs.jsonl."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ScoredPairs:
    """Per pair: the cosine similarity, whether the queries are the same once normalised,
    whether they pass the particulars guard, and whether they should hit (a paraphrase)."""

    similarity: np.ndarray
    same: np.ndarray
    guard: np.ndarray
    should: np.ndarray

    @classmethod
    def of(cls, pairs: Sequence[dict], embedder: TextEmbedder) -> ScoredPairs:
        a = [normalise(p["a"]) for p in pairs]
        b = [normalise(p["b"]) for p in pairs]
        return cls(
            np.sum(embedder.embed(a) * embedder.embed(b), axis=1),
            np.array([x == y for x, y in zip(a, b, strict=True)]),
            np.array([same_particulars(x, y) for x, y in zip(a, b, strict=True)]),
            np.array([p["kind"] == "paraphrase" for p in pairs]),
        )

    def hits(self, threshold: float, guarded: bool) -> np.ndarray:
        return self.same | ((self.similarity >= threshold) & (self.guard if guarded else True))

    def subset(self, rows: np.ndarray) -> ScoredPairs:
        return ScoredPairs(
            self.similarity[rows], self.same[rows], self.guard[rows], self.should[rows]
        )


def evaluate_pairs(
    pairs: Sequence[dict], embedder: TextEmbedder, thresholds: Sequence[float] = THRESHOLDS
) -> list[dict]:
    """One row per (threshold, guard): hit rate on paraphrases, false-hit rate on the rest."""
    scored = ScoredPairs.of(pairs, embedder)
    should = scored.should
    rows = []
    for threshold in thresholds:
        for guarded in (False, True):
            hit = scored.hits(threshold, guarded)
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


def lowest_threshold(scored: ScoredPairs, target: float, guarded: bool) -> float:
    """The lowest threshold, to 0.001, whose false-hit rate on the near misses is at most
    `target`: the one that keeps the most paraphrase hits at that rate."""
    near = scored.subset(~scored.should)
    above = {round(math.floor(float(s) * 1000) / 1000 + 0.001, 3) for s in near.similarity}
    for threshold in [0.0, *sorted(above)]:
        if threshold > 1.0:
            break
        if near.hits(threshold, guarded).mean() <= target:
            return threshold
    raise ValueError(
        f"no threshold in [0, 1] keeps the false-hit rate at most {target:.1%} on these pairs "
        f"(near misses that are the same query, or pass the guard at similarity 1)"
    )


def calibrate(
    pairs: Sequence[dict],
    embedder: TextEmbedder,
    target_false_hit_rate: float,
    guarded: bool = True,
    folds: int = 4,
    seed: int = 0,
) -> dict:
    """The threshold chosen on every pair, its rates there, and the rates of thresholds chosen
    the same way on part of the pairs and measured on the rest (k-fold, pooled): an estimate of
    what the chosen one does on queries it was not chosen on."""
    if not 0 <= target_false_hit_rate < 1:
        raise ValueError(
            f"the target false-hit rate must be in [0, 1), got {target_false_hit_rate}"
        )
    scored = ScoredPairs.of(pairs, embedder)
    if scored.should.all() or not scored.should.any():
        raise ValueError("calibrating needs both paraphrase pairs and near-miss pairs")
    threshold = lowest_threshold(scored, target_false_hit_rate, guarded)
    hit = scored.hits(threshold, guarded)
    order = np.random.default_rng(seed).permutation(len(pairs))
    held_out = np.zeros(len(pairs), dtype=bool)
    for fold in range(folds):
        test = order[fold::folds]
        train = np.setdiff1d(order, test)
        chosen = lowest_threshold(scored.subset(train), target_false_hit_rate, guarded)
        held_out[test] = scored.subset(test).hits(chosen, guarded)
    should = scored.should
    return {
        "threshold": threshold,
        "guard": guarded,
        "target_false_hit_rate": target_false_hit_rate,
        "hit_rate": float(hit[should].mean()),
        "false_hit_rate": float(hit[~should].mean()),
        "held_out_hit_rate": float(held_out[should].mean()),
        "held_out_false_hit_rate": float(held_out[~should].mean()),
        "folds": folds,
        "num_paraphrases": int(should.sum()),
        "num_near_misses": int((~should).sum()),
    }


def read_threshold(value: str) -> float:
    """`--semantic-cache-threshold`: a number, or the file `tokenmill cache calibrate` wrote."""
    try:
        return float(value)
    except ValueError:
        pass
    path = Path(value)
    if not path.is_file():
        raise ValueError(
            f"--semantic-cache-threshold {value!r}: neither a number nor a file "
            "`tokenmill cache calibrate` wrote"
        )
    try:
        return float(json.loads(path.read_text())["threshold"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"--semantic-cache-threshold {path}: not a file `tokenmill cache calibrate` wrote"
        ) from exc


def table(rows: Sequence[dict]) -> str:
    lines = ["threshold  guard  hit rate  false-hit rate", "-" * 42]
    for r in rows:
        lines.append(
            f"{r['threshold']:>9.2f}  {'on' if r['guard'] else 'off':>5}  {r['hit_rate']:>8.1%}"
            f"  {r['false_hit_rate']:>14.1%}"
        )
    return "\n".join(lines)
