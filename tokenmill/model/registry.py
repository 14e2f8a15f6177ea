"""Architecture name -> model class, so loaders never import a model file by hand."""

from __future__ import annotations

from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            + ", ".join(sorted(MODEL_CLASSES))
        )
    return MODEL_CLASSES[architecture]


def build_model(config: ModelConfig) -> nn.Module:
    return model_class(config.architecture)(config)
