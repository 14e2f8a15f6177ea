"""The Llama decoder family (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain PyTorch: the
`CausalLM` skeleton (tokenmill.model.causal_lm) with pre-norm layers and a SwiGLU MLP. A layer
the config gives a sliding window (Mistral's `sliding_window`) attends within it."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import AttentionMetadata, attention
from tokenmill.model.causal_lm import CausalLM, DecoderAttention
from tokenmill.model.layers import GatedMLP, RMSNorm, RotaryEmbedding


class LlamaAttention(DecoderAttention):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None = None
    ) -> None:
        super().__init__(config, rotary, config.head_dim**-0.5, window)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # Heads of the merged output: one view and one split, the fewest ops per decode step.
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        self.rotary(positions, q, k)
        out = attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before it): the next layer's norm
        adds the two, so each residual add rides along with a norm in one fused call."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        super().__init__(
            config, (LlamaDecoderLayer(config, rotary, window) for window in config.layer_windows)
        )
