"""KV-cache groups from a model config: equal-size groups by window, full-attention first."""

from __future__ import annotations

import dataclasses

from tokenmill.config import ModelConfig
from tokenmill.kv.groups import kv_groups

GEMMA_LIKE = ModelConfig(
    architecture="Gemma3ForCausalLM",
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    layer_types=tuple(
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
    ),
    sliding_window=512,
)


def test_gemma_layers_make_one_full_group_and_five_sliding_groups_of_three():
    groups = kv_groups(GEMMA_LIKE)
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.groups[0].layers == (5, 11, 17)
    assert groups.num_slots == 3
    assert sorted(layer for group in groups.groups for layer in group.layers) == list(range(18))
    # Layer L lives in slot slot_of[L] of group group_of[L], and nowhere else.
    for layer in range(18):
        group = groups.groups[groups.group_of[layer]]
        assert group.layers[groups.slot_of[layer]] == layer


def test_trimming_off_or_no_window_keeps_one_group_of_every_layer():
    no_window = dataclasses.replace(GEMMA_LIKE, layer_types=None, sliding_window=None)
    for groups in (kv_groups(GEMMA_LIKE, window_trimming=False), kv_groups(no_window)):
        assert groups.windows == (None,)
        assert groups.num_slots == 18
        assert groups.slot_of == tuple(range(18))


def test_every_layer_sliding_makes_one_trimmed_group():
    all_sliding = dataclasses.replace(GEMMA_LIKE, layer_types=("sliding_attention",) * 18)
    groups = kv_groups(all_sliding)
    assert groups.windows == (512,)
    assert groups.trims


def test_a_window_without_layer_types_holds_for_every_layer():
    mistral_like = dataclasses.replace(
        GEMMA_LIKE, architecture="MistralForCausalLM", layer_types=None, sliding_window=64
    )
    assert mistral_like.layer_windows == (64,) * 18
    groups = kv_groups(mistral_like)
    assert groups.windows == (64,) and groups.num_slots == 18 and groups.trims
