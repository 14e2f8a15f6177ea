"""Quantized checkpoints on disk: what `tokenmill quantize` writes and tokenmill loads back.

A Hugging Face-style directory (config.json, model.safetensors, tokenizer files) whose
config.json adds `quantization_config`, the record tokenmill.quant.checkpoint defines. Other
tools cannot run these files, and tokenmill refuses other tools' quantized checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.hf_dir import read_json, write_hf_dir
from tokenmill.quant.checkpoint import is_own_record, quantization_record
from tokenmill.quant.method import QuantMethod

if TYPE_CHECKING:  # model_loader reads checkpoints with this module
    from tokenmill.loader.model_loader import LoadedModel

CONFIG_KEY = "quantization_config"


def save_quantized(loaded: LoadedModel, method: QuantMethod, out_dir: Path) -> Path:
    """Write `loaded` (quantized by `method` at load time) as a directory tokenmill loads."""
    write_hf_dir(out_dir, loaded.config, _model_tensors(loaded.model))
    config_path = out_dir / "config.json"
    raw = read_json(config_path)
    raw[CONFIG_KEY] = quantization_record(method, loaded.model)
    config_path.write_text(json.dumps(raw, indent=2), encoding="utf-8")
    loaded.tokenizer.save_pretrained(out_dir)
    return out_dir


def saved_quantization(model_dir: Path) -> dict[str, Any] | None:
    """The quantization a model directory was saved with, or None for a float checkpoint."""
    saved = read_json(model_dir / "config.json").get(CONFIG_KEY)
    if saved is None:
        return None
    if not is_own_record(saved):
        method = saved.get("quant_method", "?") if isinstance(saved, dict) else "?"
        raise ModelLoadError(
            f"{model_dir}: quantized by another tool ({method!r}) in a layout tokenmill cannot "
            "run; load the unquantized model with --quantization instead"
        )
    return saved


def _model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under Hugging Face-style names (`model.` prefix but the head)."""
    for name, param in model.named_parameters():
        yield (name if name.startswith("lm_head.") else f"model.{name}"), param.detach()
