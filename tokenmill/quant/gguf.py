"""quantization="gguf": run a GGUF file's Q4_0, Q4_1 and Q8_0 linears on their own blocks.

Each block type repacks losslessly into a kernel format with groups of 32 and fp16 scales:
  Q8_0 (fp16 d, 32 int8 q; w = d * q)           -> int8: q and d as they are;
  Q4_1 (fp16 d, fp16 m, 16 bytes of nibbles)     -> int4: scale d, min m;
  Q4_0 (fp16 d, 16 bytes of nibbles; w = d(q-8)) -> int4: scale d, min -8d (exact in fp16).
GGUF packs value j and j + 16 of a block into byte j; the int4 kernel wants 64 values per 32
bytes, so the nibbles are regrouped (the values themselves are untouched). A linear whose
source tensors have other types (Q4_K, Q6_K, F16, ...) or mixed ones stays fp32, dequantized
as without quantization. A tied LM head reads the token embedding's blocks (llama.cpp does the
same), while the embedding table itself is dequantized for lookups.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.layers import Linear
from tokenmill.model.weights import checkpoint_target
from tokenmill.quant.int4 import pack_int4
from tokenmill.quant.linear import LM_HEAD, empty_quant_linear, replace_linears
from tokenmill.quant.method import QuantMethod
from tokenmill.quant.weight_source import GGUFBlocks, GGUFTensor, GGUFTensorReader, WeightSource

GGUF_BLOCK = 32
_FORMATS: dict[GGMLQuantizationType, dict[str, Any]] = {
    GGMLQuantizationType.Q8_0: {"kind": "int8", "group_size": GGUF_BLOCK},
    GGMLQuantizationType.Q4_0: {"kind": "int4", "group_size": GGUF_BLOCK},
    GGMLQuantizationType.Q4_1: {"kind": "int4", "group_size": GGUF_BLOCK},
}
EMBEDDING = "model.embed_tokens.weight"


class GGUFMethod(QuantMethod):
    name = "gguf"

    def load(self, model: nn.Module, source: WeightSource) -> None:
        if source.gguf is None:
            raise ValueError(
                "quantization='gguf' keeps a GGUF file's blocks, so it needs a .gguf model; "
                "use int8 or int4 for other checkpoints"
            )
        plan = plan_gguf_linears(source.gguf, source.config, model)
        replace_linears(
            model,
            lambda name, linear: empty_quant_linear(plan[name], linear) if name in plan else None,
        )
        read = packed_tensor_reader(source.gguf, source.config, plan)
        model.load_weights(source.gguf.weights(read))


def plan_gguf_linears(
    gguf: GGUFBlocks, config: ModelConfig, model: nn.Module
) -> dict[str, dict[str, Any]]:
    """Module name -> kernel format, for each float linear whose source tensors (all parts of a
    merged one) share a block type the kernels read."""
    sources: dict[str, set[GGMLQuantizationType]] = defaultdict(set)
    for hf_name, tensor in gguf.tensors():
        target, _ = checkpoint_target(config, hf_name)
        sources[target.removesuffix(".weight")].add(tensor.qtype)
        if hf_name == EMBEDDING and config.tie_word_embeddings:
            sources[LM_HEAD].add(tensor.qtype)
    plan = {}
    for name, module in model.named_modules():
        kinds = {_FORMATS[t]["kind"] if t in _FORMATS else None for t in sources.get(name, ())}
        if isinstance(module, Linear) and len(kinds) == 1 and None not in kinds:
            plan[name] = _FORMATS[next(iter(sources[name]))]
    return plan


def packed_tensor_reader(
    gguf: GGUFBlocks, config: ModelConfig, plan: dict[str, dict[str, Any]]
) -> GGUFTensorReader:
    """For `gguf.weights`: repacked blocks for the planned linears, dequantized tensors else."""

    def packed(tensor: GGUFTensor, prefix: str) -> dict[str, torch.Tensor]:
        tensors = repack_blocks(gguf.raw_bytes(tensor), tensor.qtype, tensor.shape)
        return {prefix + name: packed for name, packed in tensors.items()}

    def read(hf_name: str, tensor: GGUFTensor) -> dict[str, torch.Tensor]:
        target, _ = checkpoint_target(config, hf_name)
        if target.endswith(".weight") and target.removesuffix(".weight") in plan:
            tensors = packed(tensor, hf_name.removesuffix("weight"))
        else:
            tensors = {hf_name: gguf.dequantize(tensor)}
        if hf_name == EMBEDDING and config.tie_word_embeddings and LM_HEAD in plan:
            tensors.update(packed(tensor, f"{LM_HEAD}."))
        return tensors

    return read


def repack_blocks(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """The packed tensors (qweight, scales and, for int4, mins) holding the Q8_0, Q4_0 or Q4_1
    tensor of `shape` whose bytes are `raw`."""
    rows = int(np.prod(shape[:-1]))
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.array(raw)).view(rows, -1, type_size)
    scales = _f16_field(blocks, 0)
    if qtype == GGMLQuantizationType.Q8_0:
        values = blocks[:, :, 2:].contiguous().view(torch.int8).view(rows, -1)
        return {"qweight": values, "scales": scales}
    if qtype == GGMLQuantizationType.Q4_1:
        mins, nibbles = _f16_field(blocks, 2), blocks[:, :, 4:]
    elif qtype == GGMLQuantizationType.Q4_0:
        mins, nibbles = (scales.float() * -8).half(), blocks[:, :, 2:]
    else:
        raise ValueError(f"{qtype.name} blocks have no kernel format")
    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).view(rows, -1)  # values in order
    return {"qweight": pack_int4(codes), "scales": scales, "mins": mins}


def _f16_field(raw: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block: [rows, blocks]."""
    return raw[:, :, offset : offset + 2].contiguous().view(torch.float16).squeeze(-1)
