"""EngineArgs and ModelConfig validation: a bad switch is a ValueError naming the field."""

from __future__ import annotations

import pytest

from tokenmill.config import (
    QUANTIZATION_METHODS,
    EngineArgs,
    ModelConfig,
    parse_dtype,
    parse_memory,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float64"),
        ("kv_cache", "ring"),
        ("kv_cache_dtype", "int4"),
        ("scheduler", "fifo"),
        ("decode_loop", "jit"),
        ("quantization", "int3"),
        ("block_size", 0),
        ("max_num_seqs", -1),
        ("max_num_batched_tokens", True),
        ("max_model_len", 0),
    ],
)
def test_a_bad_switch_names_its_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 10**9), ("3 KB", 3000), (4096, 4096)],
)
def test_memory_sizes_parse_with_units(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["0", "-1GiB", "lots", "2TiB", 1.5])
def test_a_bad_memory_size_is_refused(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(text)


def test_kv_cache_memory_is_stored_as_bytes():
    assert EngineArgs(kv_cache_memory="64MiB").kv_cache_memory == 64 * 2**20


def test_every_quantization_method_name_is_accepted():
    for name in QUANTIZATION_METHODS:
        assert EngineArgs(quantization=name).quantization == name


def test_parse_dtype_refuses_unknown_names():
    assert parse_dtype("bfloat16") is not None
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("int8")


@pytest.mark.parametrize(
    ("switches", "message"),
    [
        ({"draft_model": "self:layers=4"}, "draft_model needs"),
        ({"draft_quantization": "int4"}, "draft_quantization needs"),
        ({"draft_sampling": "sample"}, "draft_sampling='sample' needs"),
        ({"speculative_method": "hydra"}, "speculative_method"),
        ({"speculative_method": "draft"}, "needs draft_model"),
        ({"speculative_method": "ngram", "kv_cache": "none"}, "needs a KV cache"),
        (
            {"speculative_method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "prompt_lookup_min",
        ),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative_method": "eagle", "speculative_tree_min_score": 1.0}, "min_score"),
    ],
)
def test_speculation_switches_that_do_not_fit_together_are_refused(switches, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**switches)


def test_model_config_needs_query_heads_a_multiple_of_kv_heads():
    shape = dict(
        architecture="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=2,
        head_dim=4,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(**shape)
    assert ModelConfig(**{**shape, "num_attention_heads": 4}).num_attention_heads == 4
