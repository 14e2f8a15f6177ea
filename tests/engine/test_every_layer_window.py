"""A Mistral-style window (`sliding_window` on every layer, no `layer_types`): SmolLM2's weights
under a config with a 64-token window generate, through prefill and decode, chunked or not,
with window trimming on and off, the greedy tokens of the same weights run with an explicit
windowed mask in plain torch; trimming then keeps only the window's blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tokenmill.loader.model_loader import LoadedModel
from tokenmill.model.registry import build_model
from tokenmill.sampling.params import SamplingParams

from .test_engine import make_engine, random_prompt, run_all, tokens

WINDOW = 64
BLOCK = 16
PROMPT = random_prompt(64, 150)  # past the window: prefill already masks
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # into a new block


@pytest.fixture(scope="module")
def windowed(smollm) -> LoadedModel:
    """SmolLM2 with `sliding_window` added to its config, sharing the loaded weights."""
    config = dataclasses.replace(smollm.config, sliding_window=WINDOW)
    with torch.device("meta"):
        model = build_model(config)
    model.load_state_dict(smollm.model.state_dict(), assign=True)
    return LoadedModel(smollm.path, config, model.eval(), smollm.tokenizer)


def reference_logits(model, token_ids: list[int], window: int) -> torch.Tensor:
    """The model's own layers, with attention as torch's SDPA under an explicit causal and
    windowed mask over the whole sequence (no KV cache, no paged kernel)."""
    n = len(token_ids)
    positions = torch.arange(n)
    offsets = positions[:, None] - positions[None, :]
    allowed = (offsets >= 0) & (offsets < window)
    hidden, residual = model.embed(torch.tensor(token_ids)), None
    for layer in model.layers:
        attn = layer.self_attn
        hidden, residual = layer.input_layernorm(hidden, residual)
        qkv = attn.qkv_proj(hidden).view(n, -1, attn.head_dim)
        q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
        attn.rotary(positions, q, k)
        out = F.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (q, k, v)),
            attn_mask=allowed,
            scale=attn.scale,
            enable_gqa=True,
        )
        hidden = attn.o_proj(out.transpose(0, 1).reshape(n, -1))
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    return model.compute_logits(model.norm(hidden, residual)[0])


def reference_greedy(model, prompt: list[int], window: int, max_tokens: int) -> list[int]:
    sequence = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            sequence.append(int(reference_logits(model, sequence, window)[-1].argmax()))
    return sequence[len(prompt) :]


@pytest.fixture(scope="module")
def expected(windowed) -> list[int]:
    return reference_greedy(windowed.model, PROMPT, WINDOW, GREEDY.max_tokens)


def test_the_window_changes_what_the_model_generates(smollm, expected):
    unwindowed = tokens(run_all(make_engine(smollm, block_size=BLOCK), [PROMPT], GREEDY))[0]
    assert unwindowed != expected


@pytest.mark.parametrize(
    ("trimming", "budget"),
    [(True, 2048), (True, 32), (False, 2048)],
    ids=["trimmed", "trimmed-chunked", "untrimmed"],
)
def test_greedy_tokens_equal_the_windowed_reference(windowed, expected, trimming, budget):
    engine = make_engine(
        windowed, block_size=BLOCK, kv_window_trimming=trimming, max_num_batched_tokens=budget
    )
    assert engine.kv_groups.windows == ((WINDOW,) if trimming else (None,))
    assert tokens(run_all(engine, [PROMPT], GREEDY))[0] == expected
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_trimming_keeps_only_the_windows_blocks(windowed):
    engine = make_engine(windowed, block_size=BLOCK)
    engine.add_request("r", PROMPT, GREEDY)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.kv_manager.num_blocks_held("r"))
    decoding = held[1:-1]  # after the prompt's step, before the request ends
    assert decoding and max(decoding) <= -(-(WINDOW - 1) // BLOCK) + 1
