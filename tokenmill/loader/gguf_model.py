"""Turn a GGUF file into a ModelConfig and Hugging Face-named weights.

llama.cpp's converter reorders the rows of the Llama query and key projections so its rotary
kernel can rotate adjacent pairs; tokenmill rotates (i, i + d/2) pairs like Hugging Face, so
those rows are put back here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.gguf_file import GGUFFile, TensorInfo

# GGUF general.architecture -> Hugging Face architecture name.
GGUF_ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

# Architectures whose GGUF conversion permuted the Q/K rows for llama.cpp's rotary layout.
_PERMUTED_QK = {"llama"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 normalises each branch's output and per-head queries/keys, and its "ffn_norm" is the
# norm before the MLP (in Llama the one after attention plays that part).
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_ARCH_LAYER_TENSORS = {"gemma3": _GEMMA3_LAYER_TENSORS}

# What llama.cpp hard-codes for Gemma 3 because its GGUFs do not store it: every sixth layer
# attends globally, the others locally with rotary base 10k.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(sorted(GGUF_ARCHITECTURES))
        )
    try:
        hidden = int(gguf.arch_value("embedding_length"))
        heads = int(gguf.arch_value("attention.head_count"))
        names = {info.name for info in gguf.tensor_infos}
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(
                gguf.arch_value("vocab_size") or len(gguf.metadata["tokenizer.ggml.tokens"])
            ),
            hidden_size=hidden,
            intermediate_size=int(gguf.arch_value("feed_forward_length")),
            num_hidden_layers=int(gguf.arch_value("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(gguf.arch_value("attention.head_count_kv", heads)),
            head_dim=int(gguf.arch_value("attention.key_length", hidden // heads)),
            rms_norm_eps=float(gguf.arch_value("attention.layer_norm_rms_epsilon")),
            rope_theta=float(gguf.arch_value("rope.freq_base", 10000.0)),
            max_position_embeddings=int(gguf.arch_value("context_length")),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            **(_gemma3_fields(gguf) if arch == "gemma3" else {}),
        )
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata lacks a model field: {exc}") from exc


def _gemma3_fields(gguf: GGUFFile) -> dict[str, object]:
    layers = int(gguf.arch_value("block_count"))
    pattern = GEMMA3_SLIDING_WINDOW_PATTERN
    return {
        "layer_types": tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ),
        "sliding_window": int(gguf.arch_value("attention.sliding_window")),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        # llama.cpp scales by 1/sqrt(head_dim) for every size but 27B (not packaged here).
        "query_pre_attn_scalar": int(gguf.arch_value("attention.key_length")),
    }


# Reads one GGUF tensor (given its Hugging Face name) as one or more named tensors.
TensorReader = Callable[[str, TensorInfo], dict[str, torch.Tensor]]


def gguf_weights(
    gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype, read: TensorReader | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named tensors of the file, each dequantized to `dtype` unless `read` makes
    something else of it (quantization="gguf" keeps blocks this way, as packed tensors whose
    rows are the weight's rows, so the row fixes below apply to them unchanged)."""
    arch = gguf.architecture
    unpermute = arch in _PERMUTED_QK
    for info in gguf.tensor_infos:
        hf_name = hf_tensor_name(info.name, arch)
        if read is None:
            tensors = {hf_name: gguf.dequantize(info).to(dtype)}
        else:
            tensors = read(hf_name, info)
        for name, tensor in tensors.items():
            yield name, _fix_rows(tensor, name, info.name, arch, unpermute, config)


class GGUFModelBlocks:
    """The file's tensors under their Hugging Face names, as stored or dequantized to the model's
    dtype: what quantization="gguf" reads (tokenmill.quant.weight_source.GGUFBlocks)."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype) -> None:
        self.gguf = gguf
        self.config = config
        self.dtype = dtype

    def tensors(self) -> Iterator[tuple[str, TensorInfo]]:
        for info in self.gguf.tensor_infos:
            yield hf_tensor_name(info.name, self.gguf.architecture), info

    def raw_bytes(self, tensor: TensorInfo) -> np.ndarray:
        return self.gguf.raw_bytes(tensor)

    def dequantize(self, tensor: TensorInfo) -> torch.Tensor:
        return self.gguf.dequantize(tensor).to(self.dtype)

    def weights(self, read: TensorReader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return gguf_weights(self.gguf, self.config, self.dtype, read)


def _fix_rows(
    tensor: torch.Tensor,
    hf_name: str,
    gguf_name: str,
    arch: str,
    unpermute: bool,
    config: ModelConfig,
) -> torch.Tensor:
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        # llama.cpp's converter stores Gemma's 1 + w; checkpoints and HF store w.
        return tensor - 1
    if unpermute and ".q_proj." in hf_name:
        return unpermute_rotary_rows(tensor, config.num_attention_heads)
    if unpermute and ".k_proj." in hf_name:
        return unpermute_rotary_rows(tensor, config.num_key_value_heads)
    return tensor


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _ARCH_LAYER_TENSORS.get(architecture, _LAYER_TENSORS)
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave: rows (0, d/2, 1, d/2+1, ...) back to (0, 1, ...)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)
