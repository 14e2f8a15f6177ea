"""quantization="gguf": run a GGUF file's linears on their own blocks.

Each block type repacks losslessly into a kernel format (the dequantized bits are the same):
  Q8_0 (fp16 d, 32 int8 q; w = d * q)            -> int8 in groups of 32: q and d as they are;
  Q5_0 (fp16 d, 5-bit q; w = d(q-16))             -> `Q50Linear`: its nibbles regrouped as
                                                     int4's, its fifth bits and d as they are
                                                     (int8 in groups of 32, q - 16 and d, with
                                                     TOKENMILL_GGUF_Q5_0=int8, the baseline);
  Q4_1 (fp16 d, fp16 m, 16 bytes of nibbles)      -> int4: scale d, min m;
  Q4_0 (fp16 d, 16 bytes of nibbles; w = d(q-8))  -> int4: scale d, min -8d (exact in fp16);
  Q4_K, Q5_K, Q6_K (super-blocks of 256)          -> their own layers (tokenmill.quant.kquant).
GGUF packs value j and j + 16 of a Q4_0 / Q4_1 block into byte j; the int4 kernel wants 64
values per 32 bytes, so those nibbles are regrouped (Q4_K's already are). A linear merged from
several tensors (q/k/v, gate/up) runs natively when its parts repack to one format (Q5_0 parts
with Q8_0 ones all become int8), and parts of several k-quant types take the q5_k layout, which
holds each exactly; a linear with a type no kernel reads, or other parts of two formats, stays
fp32, dequantized as without quantization, and the load logs one line naming the types. A tied
LM head reads the token embedding's blocks (llama.cpp does the same), and when they are int8
the lookups read them too (tokenmill/quant/tied_embedding.py); otherwise the embedding table is
dequantized for lookups.
"""

from __future__ import annotations

import logging
import os
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
from tokenmill.quant.kquant import Q4KLinear, Q5KLinear, Q6KLinear
from tokenmill.quant.linear import LM_HEAD, empty_quant_linear, replace_linears
from tokenmill.quant.method import QuantMethod
from tokenmill.quant.q5_0 import Q50Linear
from tokenmill.quant.tied_embedding import TiedInt8Embedding
from tokenmill.quant.weight_source import GGUFBlocks, GGUFTensor, GGUFTensorReader, WeightSource

GGUF_BLOCK = 32
_INT8 = {"kind": "int8", "group_size": GGUF_BLOCK}
_INT4 = {"kind": "int4", "group_size": GGUF_BLOCK}
_FORMATS: dict[GGMLQuantizationType, dict[str, Any]] = {
    GGMLQuantizationType.Q8_0: _INT8,
    GGMLQuantizationType.Q5_0: {"kind": Q50Linear.kind},
    GGMLQuantizationType.Q4_0: _INT4,
    GGMLQuantizationType.Q4_1: _INT4,
    GGMLQuantizationType.Q4_K: {"kind": Q4KLinear.kind},
    GGMLQuantizationType.Q5_K: {"kind": Q5KLinear.kind},
    GGMLQuantizationType.Q6_K: {"kind": Q6KLinear.kind},
}
# The k-quants, whose rows the q5_k layout holds alike.
_K_QUANTS = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
# The types int8 in groups of 32 holds alike (Q5_0 at 8.5 bits a weight instead of 5.5).
_INT8_HELD = {GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0}
# TOKENMILL_GGUF_Q5_0=int8 holds every Q5_0 tensor as int8, the baseline of its own kernel.
Q5_0_ENV = "TOKENMILL_GGUF_Q5_0"
EMBEDDING = "model.embed_tokens.weight"
# TOKENMILL_GGUF_EMBEDDING=table dequantizes a tied embedding into a table of its own.
EMBEDDING_ENV = "TOKENMILL_GGUF_EMBEDDING"

logger = logging.getLogger(__name__)


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
        embedding_from_head = _embeds_from_head(source.config, plan)
        if embedding_from_head:
            model.embed_tokens = TiedInt8Embedding(model.lm_head, source.dtype)
        read = packed_tensor_reader(source.gguf, source.config, plan, embedding_from_head)
        model.load_weights(source.gguf.weights(read))


def _embeds_from_head(config: ModelConfig, plan: dict[str, dict[str, Any]]) -> bool:
    """Whether lookups read the tied LM head's int8 rows (TiedInt8Embedding) instead of a
    dequantized table: TOKENMILL_GGUF_EMBEDDING=table keeps the table (the baseline)."""
    if os.environ.get(EMBEDDING_ENV, "").strip().lower() == "table":
        return False
    return config.tie_word_embeddings and plan.get(LM_HEAD) == _INT8


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
    unread: dict[str, list[str]] = defaultdict(list)  # type name(s) -> float linears
    q5_0_as_int8 = os.environ.get(Q5_0_ENV, "").strip().lower() == "int8"
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name not in sources:
            continue
        formats = {tuple(_FORMATS[t].items()) if t in _FORMATS else None for t in sources[name]}
        if sources[name] <= _INT8_HELD and (len(formats) > 1 or q5_0_as_int8):
            plan[name] = _INT8
        elif len(formats) == 1 and None not in formats:
            plan[name] = _FORMATS[next(iter(sources[name]))]
        elif sources[name] <= _K_QUANTS:
            plan[name] = _FORMATS[GGMLQuantizationType.Q5_K]
        else:
            unread[" + ".join(sorted(t.name for t in sources[name]))].append(name)
    for types, names in unread.items():
        logger.warning(
            "gguf: %d linear(s) of %s tensors have no native kernel and run dequantized (%s)",
            len(names),
            types,
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        )
    return plan


def packed_tensor_reader(
    gguf: GGUFBlocks,
    config: ModelConfig,
    plan: dict[str, dict[str, Any]],
    embedding_from_head: bool = False,
) -> GGUFTensorReader:
    """For `gguf.weights`: repacked blocks for the planned linears, dequantized tensors else;
    no embedding table when `embedding_from_head`."""

    def packed(tensor: GGUFTensor, prefix: str, kind: str) -> dict[str, torch.Tensor]:
        tensors = repack_blocks(gguf.raw_bytes(tensor), tensor.qtype, tensor.shape, kind)
        return {prefix + name: packed for name, packed in tensors.items()}

    def read(hf_name: str, tensor: GGUFTensor) -> dict[str, torch.Tensor]:
        target, _ = checkpoint_target(config, hf_name)
        module = target.removesuffix(".weight")
        if target.endswith(".weight") and module in plan:
            tensors = packed(tensor, hf_name.removesuffix("weight"), plan[module]["kind"])
        elif hf_name == EMBEDDING and embedding_from_head:
            tensors = {}
        else:
            tensors = {hf_name: gguf.dequantize(tensor)}
        if hf_name == EMBEDDING and config.tie_word_embeddings and LM_HEAD in plan:
            tensors.update(packed(tensor, f"{LM_HEAD}.", plan[LM_HEAD]["kind"]))
        return tensors

    return read


def repack_blocks(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], kind: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of the layer of `kind` (default: the one `_FORMATS[qtype]` names) holding
    the tensor of `shape` whose bytes are `raw`: qweight, scales and so on."""
    rows = int(np.prod(shape[:-1]))
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.array(raw)).view(rows, -1, type_size)
    kind = kind or _FORMATS[qtype]["kind"]
    if kind == Q5KLinear.kind:
        return _repack_q5_k_layout(blocks, qtype)
    if qtype == GGMLQuantizationType.Q4_K:
        return _repack_q4_k(blocks)
    if qtype == GGMLQuantizationType.Q6_K:
        return _repack_q6_k(blocks)
    scales = _f16_field(blocks, 0)
    if qtype == GGMLQuantizationType.Q8_0:
        values = blocks[:, :, 2:].contiguous().view(torch.int8).view(rows, -1)
        return {"qweight": values, "scales": scales}
    if qtype == GGMLQuantizationType.Q5_0 and kind == Q50Linear.kind:
        low = _nibble_halves(blocks[:, :, 6:]).view(rows, -1)
        qhigh = blocks[:, :, 2:6].reshape(rows, -1)
        return {"qweight": pack_int4(low), "qhigh": qhigh, "scales": scales}
    if qtype == GGMLQuantizationType.Q5_0:
        # Bit j of the little-endian u32 at byte 2 is value j's fifth bit.
        fifth = (blocks[:, :, 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        q = _nibble_halves(blocks[:, :, 6:]) | (fifth.reshape(rows, -1, GGUF_BLOCK) << 4)
        return {"qweight": (q.view(torch.int8) - 16).view(rows, -1), "scales": scales}
    if qtype == GGMLQuantizationType.Q4_1:
        mins, nibbles = _f16_field(blocks, 2), blocks[:, :, 4:]
    elif qtype == GGMLQuantizationType.Q4_0:
        mins, nibbles = (scales.float() * -8).half(), blocks[:, :, 2:]
    else:
        raise ValueError(f"{qtype.name} blocks have no kernel format")
    codes = _nibble_halves(nibbles).view(rows, -1)  # values in order
    return {"qweight": pack_int4(codes), "scales": scales, "mins": mins}


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight 6-bit scales s and mins m per super-block, from bytes 4-15:
    uint8 [rows, super-blocks, 8] each. Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2
    bits of scales 4-7; bytes 4-7 the same for mins; bytes 8-11 the low 4 bits of scales 4-7
    (low nibble) and mins 4-7."""
    first, second, tail = blocks[:, :, 4:16].unflatten(-1, (3, 4)).unbind(dim=2)
    s = torch.cat((first & 0x3F, (tail & 0x0F) | ((first >> 2) & 0x30)), dim=-1)
    m = torch.cat((second & 0x3F, (tail >> 4) | ((second >> 2) & 0x30)), dim=-1)
    return s, m


def _k_mins(blocks: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per group of 32, the min -(dmin * m) in fp32, as the dequantization rounds it."""
    return -(_f16_field(blocks, 2).float()[..., None] * m.float()).view(blocks.shape[0], -1)


def _repack_q4_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Super-block of 256: fp16 d and dmin, 12 bytes of 6-bit scales s and mins m, 128 bytes of
    nibbles, each 64 values as 32 bytes, low nibbles first: the int4 layout already. Per group
    of 32, scale d * s and min -(dmin * m) in fp32, as the dequantization rounds them."""
    rows = blocks.shape[0]
    s, m = _k_scales_mins(blocks)
    d = _f16_field(blocks, 0).float()
    return {
        "qweight": blocks[:, :, 16:].reshape(rows, -1),
        "scales": (d[..., None] * s.float()).view(rows, -1),
        "mins": _k_mins(blocks, m),
    }


def _repack_q5_k_layout(
    blocks: torch.Tensor, qtype: GGMLQuantizationType
) -> dict[str, torch.Tensor]:
    """A Q4_K, Q5_K or Q6_K tensor in the q5_k layout: codes as int8, an int8 scale per 16
    (Q4_K's and Q5_K's 6-bit s twice), fp16 d per 256 and an fp32 min per 32 (-0 for Q6_K)."""
    rows, supers, _ = blocks.shape
    if qtype == GGMLQuantizationType.Q6_K:
        tensors = _repack_q6_k(blocks)
        # -0.0 adds nothing to any value, a negative zero included (+0.0 would turn it positive).
        return {**tensors, "mins": torch.full((rows, supers * 8), -0.0)}
    if qtype == GGMLQuantizationType.Q4_K:
        q = _nibble_halves(blocks[:, :, 16:].reshape(rows, supers, 4, 32))
    elif qtype == GGMLQuantizationType.Q5_K:
        # 128 bytes of nibbles as Q4_K's at byte 48; bit b of byte 16 + i is the fifth bit of
        # value i of group b.
        low = _nibble_halves(blocks[:, :, 48:].reshape(rows, supers, 4, 32))
        fifth = (blocks[:, :, None, 16:48] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
        q = low.reshape(rows, supers, 8, 32) | (fifth << 4)
    else:
        raise ValueError(f"{qtype.name} blocks have no q5_k layout")
    s, m = _k_scales_mins(blocks)
    return {
        "qweight": q.reshape(rows, -1).view(torch.int8),
        "sub_scales": s.repeat_interleave(2, dim=-1).view(torch.int8).reshape(rows, -1),
        "super_scales": _f16_field(blocks, 0),
        "mins": _k_mins(blocks, m),
    }


def _repack_q6_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Super-block of 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d.
    Each 128-value half takes 64 low-nibble bytes (low then high nibbles) and 32 high-bit bytes
    (bit pairs 0-1, 2-3, 4-5, 6-7 for its four runs of 32)."""
    rows, supers, _ = blocks.shape
    low = _nibble_halves(blocks[:, :, :128].reshape(rows, supers, 2, 64))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = (blocks[:, :, 128:192].reshape(rows, supers, 2, 1, 32) >> shifts) & 0x03
    q = low | (high.reshape(low.shape) << 4)
    return {
        "qweight": (q.view(torch.int8) - 32).view(rows, -1),
        "sub_scales": blocks[:, :, 192:208].contiguous().view(torch.int8).view(rows, -1),
        "super_scales": _f16_field(blocks, 208),
    }


def _nibble_halves(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k] values: the low nibbles, then the high ones."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _f16_field(raw: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block: [rows, blocks]."""
    return raw[:, :, offset : offset + 2].contiguous().view(torch.float16).squeeze(-1)
