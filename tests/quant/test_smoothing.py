"""Moving per-channel factors across ops leaves every layer computing the same function."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant.smoothing import llama_migrations


def layer_output(layer, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = hidden.shape[0]
    meta = AttentionMetadata.build([tokens], [tokens], None, 16, None)
    with torch.inference_mode():
        return layer(torch.arange(tokens), hidden.clone(), hidden.clone(), None, meta)


@pytest.mark.parametrize("index", range(4))
def test_each_migration_preserves_the_layer(smollm, index):
    migration = llama_migrations(smollm.config)[index]
    layer = copy.deepcopy(smollm.model.layers[3])
    hidden = torch.randn(12, smollm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = layer_output(layer, hidden)
    source_channels = migration.reduce(
        torch.ones(layer.get_submodule(migration.linear).in_features)
    )
    gen = torch.Generator().manual_seed(index)
    migration.apply(layer, torch.rand(source_channels.shape[0], generator=gen) * 4 + 0.25)
    after = layer_output(layer, hidden)
    for ours, ref in zip(after, before, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_grouped_query_heads_share_their_key_value_factor(smollm):
    config = smollm.config
    to_output = llama_migrations(config)[1]
    group = config.num_attention_heads // config.num_key_value_heads
    assert to_output.fan_out == group > 1
    per_kv_channel = torch.arange(config.num_key_value_heads * config.head_dim, dtype=torch.float32)
    per_input = to_output.expand(per_kv_channel)
    assert per_input.shape[0] == config.num_attention_heads * config.head_dim
    head = 2 * group - 1  # the last query head reading key-value head 1
    torch.testing.assert_close(
        per_input.view(config.num_attention_heads, -1)[head],
        per_kv_channel.view(config.num_key_value_heads, -1)[1],
    )
    torch.testing.assert_close(to_output.reduce(per_input), per_kv_channel)
