"""Gemma 3 (text) in plain PyTorch: the `CausalLM` skeleton with Gemma's differences.

What differs from Llama: token embeddings are scaled by sqrt(hidden_size); each layer also
normalises its attention and MLP outputs (four RMSNorms a layer) and each head's queries and keys;
the MLP gates with tanh-GELU; attention scores are scaled by `query_pre_attn_scalar`; and most
layers ("sliding_attention") see only the last `sliding_window` tokens and rotate with their own
rotary base, while every sixth or so ("full_attention") sees the whole context.

Gemma's RMSNorm multiplies by (1 + weight). Checkpoints store `weight`; these modules hold
1 + weight (added at load time), so the shared fused norm kernel serves both families.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import AttentionMetadata, attention
from tokenmill.model.causal_lm import CausalLM, DecoderAttention
from tokenmill.model.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Gemma3Attention(DecoderAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        super().__init__(config, rotary, scale, window)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))[0]
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))[0]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self.rotary(positions, q, k)
        out = attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = Gemma3Attention(config, rotary, window)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = GatedMLP(size, config.intermediate_size, activation="gelu_pytorch_tanh")
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normalised MLP output, residual stream before it), the same
        contract as the Llama layer: the next norm adds the two in one fused call."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden)[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return self.post_feedforward_layernorm(hidden)[0], residual


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if config.layer_types is not None and len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(config.layer_types)} entries for "
                f"{config.num_hidden_layers} layers"
            )
        full = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        local = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_local_base_freq or config.rope_theta,
        )
        super().__init__(
            config,
            (
                Gemma3DecoderLayer(config, full if window is None else local, window)
                for window in config.layer_windows
            ),
        )
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        # Scaled in the embedding's dtype, as Gemma was trained (sqrt(640) rounds in bf16).
        return embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_unit_offset_norms(weights))


def _unit_offset_norms(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint norm weights w -> the 1 + w these modules multiply by."""
    for name, tensor in weights:
        yield name, tensor + 1 if name.endswith("norm.weight") else tensor
