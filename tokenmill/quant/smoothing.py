"""Moving a per-input-channel factor from a linear's activations into its weights.

X W^T = (X / s)(W * s)^T for any positive s per input channel. When the op producing X is an
RMSNorm or another linear, the division folds into that op's weights, so the model computes the
same function with differently shaped weights and activations. AWQ picks s to protect the
weights that meet large activations; SmoothQuant picks it to tame activation outliers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import ModelConfig


@dataclass(frozen=True)
class Migration:
    """`linear`'s inputs are produced by `source` (an RMSNorm, or rows `rows` of a linear);
    each source channel feeds `fan_out` consecutive runs of the linear's inputs (the query heads
    that share one key-value head under grouped-query attention)."""

    linear: str
    source: str
    rows: slice | None = None
    fan_out: int = 1
    head_dim: int = 1

    def expand(self, source_scales: torch.Tensor) -> torch.Tensor:
        """The factor on each of the linear's input channels, from one per source channel."""
        if self.fan_out == 1:
            return source_scales
        heads = source_scales.view(-1, 1, self.head_dim)
        return heads.expand(-1, self.fan_out, -1).reshape(-1)

    def reduce(self, channel_values: torch.Tensor, largest: bool = False) -> torch.Tensor:
        """Per-input-channel statistics down to one per source channel: the mean over the
        channels a source channel feeds, or with `largest` their maximum."""
        if self.fan_out == 1:
            return channel_values
        fed = channel_values.view(-1, self.fan_out, self.head_dim)
        return (fed.amax(dim=1) if largest else fed.mean(dim=1)).reshape(-1)

    def apply(self, layer: nn.Module, source_scales: torch.Tensor) -> None:
        """Divide the source's outputs by s and multiply the linear's input columns by s."""
        with torch.no_grad():
            source = layer.get_submodule(self.source)
            target = source.weight if self.rows is None else source.weight[self.rows]
            target.div_(source_scales.view(-1, *([1] * (target.dim() - 1))).to(target.dtype))
            bias = getattr(source, "bias", None)
            if bias is not None and self.rows is not None:
                bias[self.rows].div_(source_scales.to(bias.dtype))
            linear = layer.get_submodule(self.linear)
            linear.weight.mul_(self.expand(source_scales).to(linear.weight.dtype))


def llama_migrations(config: ModelConfig) -> list[Migration]:
    """The four places a Llama-family layer can absorb a factor: both norms into the products
    they feed, the value rows into the output projection, the up rows into the down one."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    ffn = config.intermediate_size
    return [
        Migration("self_attn.qkv_proj", "input_layernorm"),
        Migration(
            "self_attn.o_proj",
            "self_attn.qkv_proj",
            rows=slice(q_size + kv_size, q_size + 2 * kv_size),
            fan_out=config.num_attention_heads // config.num_key_value_heads,
            head_dim=config.head_dim,
        ),
        Migration("mlp.gate_up_proj", "post_attention_layernorm"),
        Migration("mlp.down_proj", "mlp.gate_up_proj", rows=slice(ffn, 2 * ffn)),
    ]


def untie_lm_head(model: nn.Module) -> None:
    """Give the LM head its own copy of a weight it shares with the embedding, so scaling the
    head's columns leaves the token embeddings alone."""
    head = model.lm_head
    if head.weight is model.embed_tokens.weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
