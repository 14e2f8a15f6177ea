"""tokenmill's Gemma 3 against transformers' on the packaged Gemma 3 270M GGUF.

The oracle runs the same weights, exported by `tokenmill export-hf`. Contexts longer than the
512-token sliding window check that local layers forget what global layers still see, in the
no-cache prefill and in the paged decode kernel alike.
"""

from __future__ import annotations

import torch

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.loader.model_loader import load_model
from tokenmill.model.attention import AttentionMetadata
from tokenmill.sampling.params import SamplingParams


def logits_without_cache(loaded, ids: list[int]) -> torch.Tensor:
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
        return loaded.model.compute_logits(hidden)


def relative_l2(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (ours - ref).norm(dim=-1) / ref.norm(dim=-1)


def test_logits_match_transformers_past_the_sliding_window(gemma, hf_gemma, long_text):
    ids = gemma.tokenizer.encode(long_text)[:600]
    assert len(ids) > gemma.config.sliding_window
    with torch.inference_mode():
        ref = hf_gemma(torch.tensor([ids])).logits[0].float()
    assert relative_l2(logits_without_cache(gemma, ids), ref).max().item() < 1e-4


def test_paged_decode_across_the_window_matches_transformers_greedy(gemma, hf_gemma, long_text):
    ids = gemma.tokenizer.encode(long_text)[:505]  # decoding crosses position 512
    with torch.inference_mode():
        expected = hf_gemma.generate(
            torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(ids) :].tolist()
    engine = LLMEngine(EngineArgs(model="gemma3-270m", kv_cache_memory="64MiB"), loaded=gemma)
    engine.add_request(
        "r", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    )
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].outputs[0].token_ids == expected


def test_exported_directory_loads_to_the_same_logits(gemma, gemma_hf_dir):
    reloaded = load_model(str(gemma_hf_dir))
    assert reloaded.config == gemma.config
    ids = gemma.tokenizer.encode("The capital of France is")
    torch.testing.assert_close(
        logits_without_cache(reloaded, ids), logits_without_cache(gemma, ids), rtol=0, atol=1e-4
    )


def test_norms_hold_one_plus_the_checkpoint_weight(gemma, hf_gemma):
    ours = gemma.model.layers[0].self_attn.q_norm.weight
    theirs = hf_gemma.model.layers[0].self_attn.q_norm.weight
    torch.testing.assert_close(ours, theirs + 1)
