"""Building blocks shared by the decoder architectures: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.kernels import ops


class Embedding(nn.Embedding):
    """nn.Embedding that leaves a meta-device weight uninitialised, as Linear does: a model built
    on the meta device takes its weights from a checkpoint, and initialising them there would
    only import torch's compiler, at every start, for nothing."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Linear(nn.Linear):
    """nn.Linear whose product goes through the kernel dispatch: decode-sized batches stream its
    weights through the native skinny kernel, wider ones run a blocked GEMM on a packed copy of
    the weight once `prepack` made one (native, or oneDNN's under torch's kernels), and torch's
    GEMM otherwise."""

    prepacked: torch.Tensor | None = None
    # What `prepacked` was made from: (batch hint, weight storage, weight version), so a model
    # shared by several engines is packed once and a weight changed in place is packed again.
    _prepacked_from: tuple[int, int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.prepacked)

    def prepack(self, batch_hint: int | None) -> None:
        """Keeps a copy of the weight laid out for batched products (`ops.prepack_linear_weight`;
        oneDNN's format takes `batch_hint`, the rows it expects), or drops it (None). Not a
        parameter: checkpoints never see it."""
        if batch_hint is None:
            self.prepacked = self._prepacked_from = None
            return
        source = (batch_hint, self.weight.data_ptr(), self.weight._version)
        if source != self._prepacked_from:
            self.prepacked = ops.prepack_linear_weight(self.weight, batch_hint)
            self._prepacked_from = source

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # on the meta device the weights come from a checkpoint
            super().reset_parameters()

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the packed copy behind: oneDNN's opaque tensors cannot be
        copied, and `prepack` remakes it."""
        state = dict(super().__getstate__())
        state.pop("prepacked", None)
        state.pop("_prepacked_from", None)
        return state

    def native_kernel(self) -> object | None:
        """These weights bound to their kernel for the native decode loop (None: none): a float32
        weight's skinny or packed kernel, a bfloat16 one's packed tiles."""
        if self.weight.dtype == torch.bfloat16:
            return ops.bfloat16_linear_kernel(self.prepacked, self.out_features, self.bias)
        return ops.float32_linear_kernel(self.weight, self.bias, self.prepacked)


def prepack_linears(model: nn.Module, batch_hint: int | None) -> None:
    """`Linear.prepack` on every float linear of the model (quantized ones have their own)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack(batch_hint)


class RMSNorm(nn.Module):
    """Adds the branch output into the residual stream, then normalises it: one fused call."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised, new residual); `residual` (or `x` when it is None) is updated in place."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair rotation speeds, with Llama 3's long-context rescaling when the config asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: linear, llama3")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Slow the low frequencies by `factor`, keep the high ones, blend smoothly in between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    in_between = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates query and key pairs (i, i + d/2) by position-dependent angles (GPT-NeoX layout)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # Plain fp32 attributes on the CPU, not buffers: the tables stay exact when the model is
        # built on the meta device and materialised, or cast to a lower precision.
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float64, device="cpu")
        angles = torch.outer(positions, inv_freq)
        self.cos = angles.cos().float()
        self.sin = angles.sin().float()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q: [tokens, heads, head_dim] and k: [tokens, kv_heads, head_dim] in place."""
        ops.rotary_embedding(positions, q, k, self.cos, self.sin)


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": ops.silu_and_mul,
    "gelu_pytorch_tanh": ops.gelu_tanh_and_mul,
}


class GatedMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU for Gemma) with gate and up projections merged
    into one matrix product."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act_and_mul = GATED_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
