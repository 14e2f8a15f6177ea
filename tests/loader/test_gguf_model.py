"""GGUF -> Hugging Face naming and layout."""

from __future__ import annotations

import pytest
import torch

from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.gguf_model import hf_tensor_name, unpermute_rotary_rows


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q and K rows (written from its documented layout)."""
    head_dim = weight.shape[0] // num_heads
    return (
        weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize(("heads", "head_dim", "cols"), [(9, 64, 576), (3, 64, 576), (4, 8, 5)])
def test_unpermute_inverts_llama_cpp_permutation(heads, head_dim, cols):
    weight = torch.randn(heads * head_dim, cols)
    assert torch.equal(unpermute_rotary_rows(llama_cpp_permute(weight, heads), heads), weight)


def test_bias_vectors_unpermute_too():
    bias = torch.randn(4 * 16)
    assert torch.equal(unpermute_rotary_rows(llama_cpp_permute(bias, 4), 4), bias)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight"),
        ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ],
)
def test_tensor_names_map_to_hugging_face(gguf_name, hf_name):
    assert hf_tensor_name(gguf_name) == hf_name


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("blk.3.ffn_norm.weight", "model.layers.3.pre_feedforward_layernorm.weight"),
        ("blk.3.post_attention_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
        ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ],
)
def test_gemma3_tensor_names_map_to_hugging_face(gguf_name, hf_name):
    assert hf_tensor_name(gguf_name, "gemma3") == hf_name


def test_gemma3_config_fills_in_what_llama_cpp_hard_codes(gemma):
    config = gemma.config
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.sliding_window == 512
    assert config.layer_types is not None and len(config.layer_types) == 18
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17]
    assert config.rope_local_base_freq == 10000.0
    assert config.query_pre_attn_scalar == config.head_dim == 256


def test_unknown_tensor_name_is_an_error():
    with pytest.raises(ModelLoadError, match="blk.0.mystery"):
        hf_tensor_name("blk.0.mystery.weight")
