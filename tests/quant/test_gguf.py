"""quantization="gguf": the file's blocks repack losslessly and the model runs on them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tokenmill.kernels import ops
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.gguf_model import GGUFModelBlocks, gguf_model_config
from tokenmill.quant.gguf import GGUFMethod, plan_gguf_linears, repack_blocks
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.weight_source import WeightSource

Q = GGMLQuantizationType


def dequantize_repacked(packed: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    if "mins" in packed:
        return ops.dequantize_int4_reference(
            packed["qweight"], packed["scales"], packed["mins"], 32, k
        )
    return ops.dequantize_int8_reference(packed["qweight"], packed["scales"], 32, k)


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.3.ffn_down.weight"])
def test_file_blocks_repack_to_exactly_the_dequantized_weight(smollm_path: Path, name: str) -> None:
    gguf = GGUFFile(smollm_path)
    info = next(i for i in gguf.tensor_infos if i.name == name)
    assert info.qtype in (Q.Q8_0, Q.Q4_1)
    packed = repack_blocks(gguf.raw_bytes(info), info.qtype, info.shape)
    assert torch.equal(dequantize_repacked(packed, info.shape[-1]), gguf.dequantize(info))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_each_block_type_repacks_losslessly(qtype: GGMLQuantizationType) -> None:
    weight = np.random.default_rng(int(qtype)).standard_normal((5, 96)).astype(np.float32)
    raw = quants.quantize(weight, qtype)
    packed = repack_blocks(raw.reshape(-1), qtype, weight.shape)
    expected = torch.from_numpy(quants.dequantize(raw, qtype))
    assert torch.equal(dequantize_repacked(packed, 96), expected)


def test_every_linear_of_the_q4_1_file_runs_on_its_blocks(quantized_smollm) -> None:
    model = quantized_smollm("gguf").model
    body = [m for name, m in model.named_modules() if name.startswith("layers.")]
    assert sum(isinstance(m, Int4Linear) for m in body) == 4 * len(model.layers)
    assert isinstance(model.lm_head, Int8Linear)  # the tied head reads token_embd's Q8_0
    assert model.lm_head.group_size == 32
    assert model.embed_tokens.weight.dtype == torch.float32


def test_loaded_layer_holds_the_files_blocks(smollm_path: Path, quantized_smollm) -> None:
    gguf = GGUFFile(smollm_path)
    info = next(i for i in gguf.tensor_infos if i.name == "blk.0.attn_output.weight")
    packed = repack_blocks(gguf.raw_bytes(info), info.qtype, info.shape)
    layer = quantized_smollm("gguf").model.layers[0].self_attn.o_proj
    assert torch.equal(layer.qweight, packed["qweight"])
    assert torch.equal(layer.mins, packed["mins"])


def test_types_without_a_kernel_stay_float(smollm_path: Path, smollm) -> None:
    gguf = GGUFFile(smollm_path)
    gguf.tensor_infos = [
        dataclasses.replace(i, qtype=Q.Q6_K) if i.name == "blk.0.attn_k.weight" else i
        for i in gguf.tensor_infos
    ]
    config = gguf_model_config(gguf)
    plan = plan_gguf_linears(GGUFModelBlocks(gguf, config, torch.float32), config, smollm.model)
    assert "layers.0.self_attn.qkv_proj" not in plan  # q and v are Q4_1, k is not: all float
    assert plan["layers.1.self_attn.qkv_proj"] == {"kind": "int4", "group_size": 32}


def test_gguf_quantization_needs_a_gguf_file(smollm) -> None:
    source = WeightSource(smollm.config, torch.float32, iter(()), gguf=None)
    with pytest.raises(ValueError, match=r"needs a \.gguf model"):
        GGUFMethod().load(torch.nn.Module(), source)
