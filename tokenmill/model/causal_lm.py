"""What every tokenmill decoder model shares: token embedding, a stack of decoder layers, final
norm and LM head, and the projections of its attention. Each architecture (llama.py, gemma3.py)
supplies its layers and what it does differently.

The forward pass takes one flat batch of tokens from many sequences; what belongs to which
sequence, and where its keys and values live, is the `AttentionMetadata`'s business.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import StepMetadata
from tokenmill.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from tokenmill.model.weights import load_hf_weights


class DecoderAttention(nn.Module):
    """Self-attention's projections: queries, keys and values in one merged product, and the
    output one. Subclasses say how the heads attend (`forward`); a sliding `window` lets each
    token see only itself and the `window - 1` tokens before it."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        scale: float,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = scale
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Every layer takes (positions, hidden,
    residual, kv_cache, meta) and returns (output, residual stream before it): the next norm
    adds the two in one fused call."""

    def __init__(self, config: ModelConfig, layers: Iterable[nn.Module]) -> None:
        """`layers` may be a generator: it is consumed after the embedding is made, so
        parameters are created in the order embedding, layers, norm, head."""
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
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
        meta: StepMetadata,
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`; the caller picks which rows to project.
        Each layer reads its KV through `meta.for_layer(i)` (its KV-cache group's tables)."""
        hidden = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            kv_cache = None if kv_caches is None else kv_caches[i]
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta.for_layer(i))
        return self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the LM head's dtype: greedy sampling takes a bfloat16 row's argmax as it is, and
        whatever computes with logits widens them (tokenmill/sampling/sampler.py)."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named checkpoint tensors in (tokenmill.model.weights)."""
        self.tie_weights()
        load_hf_weights(self, self.config, weights)
