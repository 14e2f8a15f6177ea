"""Copy a Hugging Face-named checkpoint into a tokenmill model, whatever the architecture.

Checkpoints keep q/k/v and gate/up as separate matrices; tokenmill's models merge each group
into one product, so loading writes each checkpoint tensor into its rows of the merged weight
and checks that every parameter (every row range of a merged one) was written exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig


def load_hf_weights(
    model: nn.Module, config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy Hugging Face-named tensors in, packing q/k/v and gate/up into merged matrices."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = _packed_slices(config)
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target, rows = checkpoint_target(config, name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[target]
        dest = param.data if rows is None else param.data[rows]
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add(target if rows is None else f"{target}[{rows}]")
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    expected = _expected_names(params, packed)
    # A merged parameter loaded whole (tokenmill's own quantized checkpoints) has all its rows.
    missing = sorted(name for name in expected - loaded if name.partition("[")[0] not in loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:8])}")


def checkpoint_target(config: ModelConfig, name: str) -> tuple[str, slice | None]:
    """The parameter a Hugging Face-named tensor loads into, and its rows when that parameter
    merges several checkpoint matrices (`model.layers.0.self_attn.k_proj.weight` ->
    `layers.0.self_attn.qkv_proj.weight`, rows q_size .. q_size + kv_size)."""
    name = name.removeprefix("model.")
    for part, (merged, start, stop) in _packed_slices(config).items():
        if f".{part}." in name:
            return name.replace(part, merged), slice(start, stop)
    return name, None


def _packed_slices(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint projection name -> (merged parameter name, first row, end row)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    ffn = config.intermediate_size
    return {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, q + kv),
        "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
        "gate_proj": ("gate_up_proj", 0, ffn),
        "up_proj": ("gate_up_proj", ffn, 2 * ffn),
    }


def _expected_names(
    params: dict[str, nn.Parameter], packed: dict[str, tuple[str, int, int]]
) -> set[str]:
    expected: set[str] = set()
    for name in params:
        merged_parts = [
            (start, stop) for merged, start, stop in packed.values() if f".{merged}." in name
        ]
        if not merged_parts:
            expected.add(name)
        for start, stop in merged_parts:
            expected.add(f"{name}[{slice(start, stop)}]")
    return expected
