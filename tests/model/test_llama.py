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


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_tokens_match_transformers_generate(smollm, hf_smollm, index):
    from tokenmill.config import EngineArgs
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.sampling.params import SamplingParams

    ids = smollm.tokenizer.encode(PROMPTS[index])
    with torch.inference_mode():
        generated = hf_smollm.generate(
            torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )[0, len(ids) :].tolist()
    engine = LLMEngine(EngineArgs(model=str(smollm.path), kv_cache_memory="64MiB"), loaded=smollm)
    engine.add_request(
        "r",
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=32, min_tokens=32),  # as min_new_tokens
    )
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].outputs[0].token_ids == generated
