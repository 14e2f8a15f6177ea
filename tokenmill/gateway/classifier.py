"""The routing classifier: logistic regression over prompt embeddings, giving the probability
that a prompt needs the large model (the small one answered it wrong and the large one right).

Trained by `tokenmill router train` on calibration results; saved as JSON (weights, bias, the
embedder it was trained with), small enough to read at a glance.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.gateway.embedding import TextEmbedder, packaged_embedder

EMBEDDER_NAME = "wordllama-l2_supercat_256"


@dataclass
class RouteClassifier:
    weights: np.ndarray  # [dim]
    bias: float
    embedder: TextEmbedder

    def prob_large(self, texts: Sequence[str]) -> np.ndarray:
        return _sigmoid(self.embedder.embed(texts) @ self.weights + self.bias)

    def save(self, path: str | Path) -> None:
        data = {"embedder": EMBEDDER_NAME, "bias": self.bias, "weights": self.weights.tolist()}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> RouteClassifier:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"routing classifier {path}: cannot read it: {exc}") from exc
        if data.get("embedder") != EMBEDDER_NAME:
            raise ValueError(f"routing classifier {path}: trained with another embedder")
        embedder = packaged_embedder()
        weights = np.asarray(data["weights"], dtype=np.float32)
        if weights.shape != (embedder.dim,):
            raise ValueError(f"routing classifier {path}: weights are not {embedder.dim}-dim")
        return cls(weights, float(data["bias"]), embedder)


def train_classifier(
    texts: Sequence[str],
    needs_large: Sequence[bool],
    embedder: TextEmbedder,
    l2: float = 1e-2,
    steps: int = 500,
    lr: float = 1.0,
) -> RouteClassifier:
    """Full-batch gradient descent on the L2-regularised log loss, the classes weighted so the
    rarer one counts as much as the commoner."""
    x = embedder.embed(texts).astype(np.float64)
    y = np.asarray(needs_large, dtype=np.float64)
    positives = y.sum()
    if positives in (0, len(y)):
        raise ValueError("training needs prompts of both labels (small enough, and not)")
    sample_weight = np.where(y == 1, len(y) / (2 * positives), len(y) / (2 * (len(y) - positives)))
    w, b = np.zeros(x.shape[1]), 0.0
    for _ in range(steps):
        error = (_sigmoid(x @ w + b) - y) * sample_weight / len(y)
        w -= lr * (x.T @ error + l2 * w)
        b -= lr * error.sum()
    return RouteClassifier(w.astype(np.float32), float(b), embedder)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))
