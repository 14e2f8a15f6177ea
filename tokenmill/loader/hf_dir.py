"""Load a Hugging Face model directory: config.json plus one or many *.safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tokenmill.config import ModelConfig
from tokenmill.loader.errors import ModelLoadError

SHARD_INDEX = "model.safetensors.index.json"

# Hugging Face model_type where it is not the lower-cased architecture prefix.
_HF_MODEL_TYPES = {"Gemma3ForCausalLM": "gemma3_text"}

# Architectures whose q/k/v projections always carry a bias, whatever config.json says.
_QKV_BIAS_ARCHITECTURES = {"Qwen2ForCausalLM"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: missing (expected a JSON file)") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc


def hf_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    raw = read_json(path)
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{path}: no 'architectures' entry")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return ModelConfig(
            architecture=architectures[0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(
                raw.get("rope_theta")
                or raw.get("rope_parameters", {}).get("full_attention", {}).get("rope_theta")
                or 10000.0
            ),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False))
            or architectures[0] in _QKV_BIAS_ARCHITECTURES,
            rope_scaling=raw.get("rope_scaling"),
            **(_gemma3_fields(raw) or _sliding_window_fields(raw)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: missing or invalid field: {exc}") from exc


def _gemma3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Sliding-window fields, from transformers 4's flat names or 5's `rope_parameters`."""
    if raw.get("model_type") not in ("gemma3_text", "gemma3"):
        return {}
    layers = int(raw["num_hidden_layers"])
    pattern = int(raw.get("sliding_window_pattern") or 6)
    layer_types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    rope = raw.get("rope_parameters") or {}
    local_base = raw.get("rope_local_base_freq") or rope.get("sliding_attention", {}).get(
        "rope_theta", 10000.0
    )
    return {
        "layer_types": tuple(layer_types),
        "sliding_window": int(raw.get("sliding_window") or 4096),
        "rope_local_base_freq": float(local_base),
        "query_pre_attn_scalar": int(raw.get("query_pre_attn_scalar") or 256),
    }


def _sliding_window_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The Llama family's window: Mistral's `sliding_window` holds for every layer; Qwen2's only
    with `use_sliding_window`, and then from layer `max_window_layers` on (as transformers
    reads it); transformers 5's `layer_types` say which layers where given."""
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return {}
    layer_types = raw.get("layer_types")
    if layer_types is None and "max_window_layers" in raw and raw.get("use_sliding_window"):
        first = int(raw["max_window_layers"])
        layer_types = [
            "sliding_attention" if i >= first else "full_attention"
            for i in range(int(raw["num_hidden_layers"]))
        ]
    fields: dict[str, Any] = {"sliding_window": int(window)}
    if layer_types is not None:
        fields["layer_types"] = tuple(layer_types)
    return fields


def shard_paths(model_dir: Path) -> list[Path]:
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files (expected model weights)")
    return shards


def hf_weights(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in shard_paths(model_dir):
        try:
            with safe_open(shard, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = handle.get_tensor(name)
                    # Packed integer weights of a quantized checkpoint keep their dtype.
                    yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{shard}: not a readable safetensors file: {exc}") from exc


def write_hf_dir(
    model_dir: Path, config: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """Write config.json and model.safetensors, the inverse of the two readers above."""
    model_dir.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": _HF_MODEL_TYPES.get(
            config.architecture, config.architecture.removesuffix("ForCausalLM").lower()
        ),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "rope_scaling": config.rope_scaling,
        "torch_dtype": "float32",
    }
    if config.layer_types is not None:
        raw |= {
            "layer_types": list(config.layer_types),
            "sliding_window": config.sliding_window,
            "rope_local_base_freq": config.rope_local_base_freq,
            "query_pre_attn_scalar": config.query_pre_attn_scalar,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    elif config.sliding_window is not None:
        raw["sliding_window"] = config.sliding_window
    (model_dir / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    tensors = {name: tensor.contiguous() for name, tensor in weights}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
