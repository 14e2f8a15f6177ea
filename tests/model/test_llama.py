"""tokenmill's Llama forward pass against transformers' on the real SmolLM2 GGUF."""

from __future__ import annotations

import pytest
import torch

from tokenmill.loader.model_loader import LoadedModel
from tokenmill.model.attention import AttentionMetadata

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


def tokenmill_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position, computed without a KV cache in one forward pass."""
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
        return loaded.model.compute_logits(hidden)


def relative_l2(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (ours - ref).norm(dim=-1) / ref.norm(dim=-1)


@pytest.mark.parametrize("index", range(len(PROMPTS) + 1))
def test_logits_match_transformers_at_every_position(smollm, hf_smollm, long_text, index):
    text = long_text if index == len(PROMPTS) else PROMPTS[index]
    ids = smollm.tokenizer.encode(text)
    if index == len(PROMPTS):
        ids = ids[:600]
        assert len(ids) > 512
    with torch.inference_mode():
        ref = hf_smollm(torch.tensor([ids])).logits[0].float()
    assert relative_l2(tokenmill_logits(smollm, ids), ref).max().item() < 1e-4


def test_tied_embeddings_share_storage(smollm):
    assert smollm.config.tie_word_embeddings
    assert smollm.model.lm_head.weight.data_ptr() == smollm.model.embed_tokens.weight.data_ptr()
