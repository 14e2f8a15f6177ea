"""Gemma 3 (text) in plain PyTorch: the Llama skeleton with Gemma's differences.

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
from tokenmill.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from tokenmill.model.weights import load_hf_weights

SLIDING = "sliding_attention"


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = window
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary

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


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        layer_types = config.layer_types or ("full_attention",) * config.num_hidden_layers
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for {config.num_hidden_layers} layers"
            )
        full = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        local = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_local_base_freq or config.rope_theta,
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, local, config.sliding_window)
            if kind == SLIDING
            else Gemma3DecoderLayer(config, full, None)
            for kind in layer_types
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        # A quantized head (a QuantLinear put in at load time) keeps its own packed copy.
        if self.config.tie_word_embeddings and isinstance(self.lm_head, Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`; the caller picks which rows to project."""
        hidden = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            kv_cache = None if kv_caches is None else kv_caches[i]
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        # Scaled in the embedding's dtype, as Gemma was trained (sqrt(640) rounds in bf16).
        return embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the LM head's dtype: greedy sampling takes a bfloat16 row's argmax as it is, and
        whatever computes with logits widens them (tokenmill/sampling/sampler.py)."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tie_weights()
        load_hf_weights(self, self.config, _unit_offset_norms(weights))


def _unit_offset_norms(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint norm weights w -> the 1 + w these modules multiply by."""
    for name, tensor in weights:
        yield name, tensor + 1 if name.endswith("norm.weight") else tensor
