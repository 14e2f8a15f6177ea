"""One entry point from `--model` to a ready model and its tokenizer, whatever the format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.gguf_model import GGUFModelBlocks, gguf_model_config
from tokenmill.loader.hf_dir import hf_model_config, hf_weights
from tokenmill.loader.quantized_checkpoint import saved_quantization
from tokenmill.loader.resolve import resolve_model
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.model.registry import build_model
from tokenmill.quant.method import QuantMethod
from tokenmill.quant.registry import load_model_weights
from tokenmill.quant.weight_source import WeightSource


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer


def load_model_config(model: str) -> ModelConfig:
    """The model's shape alone, no weights read (`--model` as `load_model` takes it)."""
    path = resolve_model(model)
    return hf_model_config(path) if path.is_dir() else gguf_model_config(GGUFFile(path))


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    quantization: str | QuantMethod = "none",
) -> LoadedModel:
    """`quantization` names a method of tokenmill.quant.registry (or is one, configured); a
    checkpoint `tokenmill quantize` wrote loads as it was saved."""
    path = resolve_model(model)
    blocks, saved = None, None
    if path.is_dir():
        config = hf_model_config(path)
        tokenizer = Tokenizer.from_pretrained_dir(path)
        weights = hf_weights(path, dtype)
        saved = saved_quantization(path)
    else:
        gguf = GGUFFile(path)
        config = gguf_model_config(gguf)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        blocks = GGUFModelBlocks(gguf, config, dtype)
        weights = blocks.weights()
    with torch.device("meta"):
        module = build_model(config)
    module = _allocate(module, dtype)
    source = WeightSource(config, dtype, weights, blocks, saved, tokenizer)
    load_model_weights(module, quantization, source)
    return LoadedModel(path, config, module.eval(), tokenizer)


def _allocate(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module.to_empty(device="cpu").to(dtype)` without its Python path for meta tensors,
    which imports torch's symbolic shapes (and sympy) on every start. The weights are left
    uninitialised, as there: the loader writes every one (the models hold no buffers)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)

    return module._apply(empty)
