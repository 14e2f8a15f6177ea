"""The Q4_K / Q5_K / Q6_K encoders: `gguf.quants` decodes their blocks back near the weights,
and the Q4_K_M and Q5_K_M mixes pick llama.cpp's type for each tensor."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tokenmill.quant.gguf_blocks import quantize_blocks, tensor_type

Q = GGMLQuantizationType
# Root-mean-square error over the weights' RMS, Gaussian weights. Measured 0.079 for Q4_K (as
# Q4_1, 0.078: the same 4 bits and a min per 32), 0.038 for Q5_K (as Q5_1) and 0.019 for Q6_K.
MAX_RELATIVE_RMS_ERROR = {Q.Q4_K: 0.09, Q.Q5_K: 0.045, Q.Q6_K: 0.025}


def decoded(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(quantize_blocks(weight, qtype), qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_blocks_decode_close_to_the_weight(qtype: GGMLQuantizationType) -> None:
    weight = torch.randn(32, 512, generator=torch.Generator().manual_seed(int(qtype)))
    error = (decoded(weight, qtype) - weight).pow(2).mean().sqrt() / weight.pow(2).mean().sqrt()
    assert error.item() < MAX_RELATIVE_RMS_ERROR[qtype]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_zero_rows_decode_to_zeros_not_nan(qtype: GGMLQuantizationType) -> None:
    weight = torch.zeros(2, 512)
    weight[1, 256:] = torch.randn(256)  # a zero super-block beside a live one
    result = decoded(weight, qtype)
    assert torch.equal(result[0], weight[0])
    assert torch.equal(result[1, :256], weight[1, :256])


def test_blocks_have_the_files_row_bytes() -> None:
    weight = torch.randn(3, 512)
    assert quantize_blocks(weight, Q.Q4_K).shape == (3, 2 * 144)
    assert quantize_blocks(weight, Q.Q5_K).shape == (3, 2 * 176)
    assert quantize_blocks(weight, Q.Q6_K).shape == (3, 2 * 210)


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("token_embd.weight", (1000, 512), Q.Q6_K),
        ("blk.0.attn_v.weight", (64, 512), Q.Q6_K),  # first eighth of 16 layers
        ("blk.4.ffn_down.weight", (512, 1024), Q.Q6_K),  # every third between
        ("blk.5.attn_v.weight", (64, 512), Q.Q4_K),
        ("blk.5.attn_q.weight", (512, 512), Q.Q4_K),
        ("blk.15.ffn_down.weight", (512, 1024), Q.Q6_K),  # last eighth
        ("blk.5.attn_q.weight", (576, 576), Q.Q5_0),  # rows not whole super-blocks
        ("blk.0.attn_v.weight", (64, 576), Q.Q8_0),
        ("blk.0.attn_norm.weight", (512,), None),
    ],
)
def test_q4_k_m_mix_follows_llama_cpp(name, shape, expected) -> None:
    assert tensor_type("q4_k_m", name, shape, num_layers=16) == expected


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("output.weight", (1000, 512), Q.Q6_K),
        ("blk.0.ffn_down.weight", (512, 1024), Q.Q6_K),  # first eighth of 16 layers
        ("blk.5.ffn_down.weight", (512, 1024), Q.Q5_K),
        ("blk.5.attn_q.weight", (512, 512), Q.Q5_K),
        ("blk.5.attn_q.weight", (576, 576), Q.Q5_1),  # rows not whole super-blocks
    ],
)
def test_q5_k_m_mix_follows_llama_cpp(name, shape, expected) -> None:
    assert tensor_type("q5_k_m", name, shape, num_layers=16) == expected


def test_q6_k_mix_puts_every_matrix_in_q6_k() -> None:
    assert tensor_type("q6_k", "blk.5.attn_q.weight", (512, 512), 16) == Q.Q6_K
    assert tensor_type("q6_k", "blk.5.attn_q.weight", (576, 576), 16) == Q.Q8_0


def test_an_unknown_mix_is_a_value_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="q4_k_m, q5_k_m, q6_k"):
        tensor_type("q3_k_m", "blk.0.attn_q.weight", (256, 256), 16)
