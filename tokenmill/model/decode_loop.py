"""The native decode loop: a decode step's decoder layers run in one C++ call.

Driving a decode step's kernels from Python (module calls, dispatch checks, views: a dozen calls
a layer, every layer) adds host time that is a large share of a small batch's step
(docs/benchmarks.md has the figures). `NativeDecodeLoop` hands the same kernels, the same
weights and the same call order to csrc/decode_loop.cpp, so the hidden states are bit-identical
to the Python layers' and only the host overhead goes, as CUDA graphs take it away on GPUs.

It covers what the native kernels cover: Llama-family and Gemma 3 models whose linears are
float32, fp8, int8, int4 (GGUF, GPTQ, AWQ) or W8A8 (SmoothQuant's int8 panels), or bfloat16 on
their packed tiles, over a KV cache in the model dtype or int8 / fp8, with Gemma's extra norms,
sliding windows and tanh-GELU done the Python layers' way; and steps whose tokens all attend to
cached context (decodes and short speculative chunks, draft trees' included), as many as its
kernels take (32 with plain float32 or fp8 weights, 64 with int8 / int4, 4 with W8A8, 256 with
packed float32 or bfloat16). Anything else runs layer by layer in Python; `decode_loop="python"`
is the baseline it is measured against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenmill.kernels import op_timer, ops
from tokenmill.kv.quantized import KVCache, QuantizedKVCache
from tokenmill.model.attention import StepMetadata
from tokenmill.model.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from tokenmill.model.llama import LlamaDecoderLayer, LlamaForCausalLM

# The gated MLP activations the native loop knows, by their config names.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class NativeLayers:
    """Decoder layers of one architecture run in one native call over their paged KV caches."""

    def __init__(self, loop: object, kv_caches: Sequence[KVCache], max_tokens: int) -> None:
        self.loop = loop
        self.max_tokens = max_tokens  # the most tokens a step may have to run here
        self.kv_values = [c.values if isinstance(c, QuantizedKVCache) else c for c in kv_caches]
        # Empty for caches in the model dtype; else the int8 / fp8 caches' scales, one a layer.
        self.kv_scales = [c.scales for c in kv_caches if isinstance(c, QuantizedKVCache)]

    @classmethod
    def build(
        cls,
        layers: Sequence[LlamaDecoderLayer | Gemma3DecoderLayer],
        kv_caches: Sequence[KVCache],
    ) -> NativeLayers | None:
        """The native loop over `layers` (one KV cache each), or None when some part of them
        has no native kernel (a weight format or dtype without one, or the torch kernels)."""
        weights = [_layer_weights(layer) for layer in layers]
        if not weights or any(w is None for w in weights):
            return None
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        loop = ops.decode_loop(
            [w for w, _ in weights],
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            first.input_layernorm.eps,
            attn.scale,
            ACTIVATIONS[mlp.activation],
        )
        return cls(loop, kv_caches, min(max_rows for _, max_rows in weights))

    def applies(self, meta: StepMetadata) -> bool:
        """Every token attends to cached context (no prefill) and the skinny kernels take them."""
        return (
            meta.decode is not None
            and not meta.prefills
            and meta.slot_mapping is not None
            and meta.num_tokens <= self.max_tokens
        )

    def run(
        self, hidden: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, residual stream before it) for the first layer's input
        `hidden`, as the Python layers return them: the final norm adds the two."""
        assert meta.decode is not None and meta.slot_mapping is not None
        layers = [meta.for_layer(i) for i in range(len(self.kv_values))]
        args = (
            hidden,
            positions,
            self.kv_values,
            self.kv_scales,
            [layer.slot_mapping for layer in layers],
            [layer.decode.block_tables for layer in layers if layer.decode is not None],
            meta.decode.seq_lens,
            meta.decode.key_mask,
        )
        if op_timer.RECORDER is not None:  # a profile is on (tokenmill bench roofline)
            return op_timer.timed_decode_loop(self, self.loop, args)
        return self.loop.run(*args)


class NativeDecodeLoop:
    """A model's decode step: its embedding, its layers in one native call, its final norm."""

    def __init__(self, model: LlamaForCausalLM | Gemma3ForCausalLM, layers: NativeLayers) -> None:
        self.model = model
        self.layers = layers

    @classmethod
    def build(
        cls, model: nn.Module, kv_caches: Sequence[KVCache] | None
    ) -> NativeDecodeLoop | None:
        """The loop for this model and its KV caches, or None when some part of the step has
        no native kernel (another architecture, a weight format or dtype without one, or the
        torch kernels)."""
        if not isinstance(model, LlamaForCausalLM | Gemma3ForCausalLM) or not kv_caches:
            return None
        layers = NativeLayers.build(list(model.layers), kv_caches)
        return None if layers is None else cls(model, layers)

    def applies(self, meta: StepMetadata) -> bool:
        return self.layers.applies(meta)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """The model's final hidden states `[num_tokens, hidden]`, as `model(...)` returns them."""
        hidden, residual = self.layers.run(self.model.embed(input_ids), positions, meta)
        return self.model.norm(hidden, residual)[0]


def run_step(
    model: nn.Module,
    loop: NativeDecodeLoop | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: Sequence[KVCache] | None,
    meta: StepMetadata,
) -> torch.Tensor:
    """The model's final hidden states for one step: through `loop` when it covers the step,
    else layer by layer in Python (always, when there is no loop)."""
    if loop is not None and loop.applies(meta):
        return loop(input_ids, positions, meta)
    return model(input_ids, positions, kv_caches, meta)


def _layer_weights(layer: LlamaDecoderLayer | Gemma3DecoderLayer) -> tuple[object, int] | None:
    """A layer's weights for the native loop and the most tokens its kernels take, or None when
    a linear has no native kernel or the norms are not of the linears' dtype (float32, or
    bfloat16 with bfloat16 linears)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    kernels = [linear.native_kernel() for linear in linears]
    if isinstance(layer, Gemma3DecoderLayer):
        mlp_norm = layer.pre_feedforward_layernorm
        gemma_norms = (
            attn.q_norm,
            attn.k_norm,
            layer.post_attention_layernorm,
            layer.post_feedforward_layernorm,
        )
    else:
        mlp_norm, gemma_norms = layer.post_attention_layernorm, ()
    window = attn.window
    norms = [n.weight for n in (layer.input_layernorm, mlp_norm, *gemma_norms)]
    if mlp.activation not in ACTIVATIONS or any(k is None for k in kernels):
        return None
    on_bfloat16 = [k.kind == "bfloat16" for k in kernels]
    dtype = torch.bfloat16 if all(on_bfloat16) else torch.float32
    if any(on_bfloat16) != all(on_bfloat16) or any(n.dtype != dtype for n in norms):
        return None
    qkv, o, gate_up, down = kernels
    weights = ops.decoder_layer_weights(
        norms[0],
        qkv,
        o,
        norms[1],
        gate_up,
        down,
        (attn.rotary.cos, attn.rotary.sin),
        window,
        *norms[2:],
    )
    return weights, min(ops.linear_kernel_max_rows(k) for k in kernels)
