"""Sentence embeddings for the semantic cache and the routing classifier: WordLlama's token
embedding table, averaged over a text's tokens and scaled to unit length.

The table and its tokenizer ship inside the `wordllama` wheel, so nothing is downloaded at run
time. They are read straight from the package's folder: importing `wordllama` itself would
configure the root logger and needs dependencies the embedding does not.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

WORDLLAMA = "wordllama==0.4.0.post1"
WEIGHTS = "weights/l2_supercat_256.safetensors"
TOKENIZER = "tokenizers/l2_supercat_tokenizer_config.json"


class TextEmbedder:
    def __init__(self, table: np.ndarray, tokenizer: Tokenizer) -> None:
        self.table = np.ascontiguousarray(table, dtype=np.float32)  # [vocab, dim]
        self.tokenizer = tokenizer

    @property
    def dim(self) -> int:
        return self.table.shape[1]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32 rows of unit length (a text without tokens: zeros)."""
        result = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, encoding in enumerate(self.tokenizer.encode_batch(list(texts), False)):
            ids = np.clip(np.asarray(encoding.ids, dtype=np.int64), 0, len(self.table) - 1)
            if len(ids):
                mean = self.table[ids].mean(axis=0)
                result[row] = mean / max(float(np.linalg.norm(mean)), 1e-12)
        return result


@functools.cache
def packaged_embedder() -> TextEmbedder:
    """The WordLlama embedder from the installed wheel (loaded once per process)."""
    spec = importlib.util.find_spec("wordllama")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the semantic cache and the routing classifier need {WORDLLAMA!r} "
            f"(its wheel ships the embedding weights): pip install --no-deps {WORDLLAMA}"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    with safe_open(str(root / WEIGHTS), framework="np") as f:
        table = f.get_tensor("embedding.weight")
    tokenizer = Tokenizer.from_file(str(root / TOKENIZER))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return TextEmbedder(table, tokenizer)
