"""A decoder layer's ops between its products, and greedy sampling's argmax: each reads its
rows once and takes no weight matrix (csrc/rms_norm.cpp, rotary.cpp, gated_activation.cpp,
argmax.cpp). All take float32, or a bfloat16 model's tensors computed in float32 and rounded
where the references round.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch.nn import functional as F

from tokenmill.kernels.dispatch import float32_or_bfloat16, native_friendly, native_or


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        residual = x
    else:
        residual.add_(x)
    return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual


def _add_rms_norm_fits(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> bool:
    tensors = (x, weight) if residual is None else (x, residual, weight)
    return (residual is None or residual.is_contiguous()) and float32_or_bfloat16(tensors)


@native_or(add_rms_norm_reference, _add_rms_norm_fits)
def add_rms_norm(
    native: ModuleType,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `residual + x` (of `x` alone when residual is None) fused with that add.

    x, residual: [..., D]; weight: [D]. Returns (normed, new_residual); normed is a new tensor.
    On both backends the sum is written into `residual` in place and new_residual *is* that
    tensor (or `x` itself when residual is None), so the caller just rebinds its residual. All
    float32, or all bfloat16 (computed in float32, rounded where torch's reference rounds).
    """
    return native.add_rms_norm(x, residual, weight, eps), x if residual is None else residual


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    cos_rows, sin_rows = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, d/2]
    for x in (q, k):
        first, second = x.chunk(2, dim=-1)
        x.copy_(
            torch.cat(
                (first * cos_rows - second * sin_rows, second * cos_rows + first * sin_rows),
                dim=-1,
            )
        )


def _rotary_embedding_fits(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    return (
        positions.dtype == torch.int64
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and native_friendly((cos, sin))
        and float32_or_bfloat16((q, k))
    )


@native_or(rotary_embedding_reference, _rotary_embedding_fits)
def rotary_embedding(
    native: ModuleType,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotates q [T, H, d] and k [T, KVH, d] in place by their tokens' positions (int64 [T]),
    GPT-NeoX layout: each pair (i, i + d/2) by the angle whose cos/sin are row `positions[t]`,
    column i of cos/sin [max_positions, d/2].

    q and k may be strided views (e.g. column slices of the merged qkv output): native writes
    through any token and head stride as long as each head's d values are contiguous. q and k
    may be bfloat16 (cos and sin float32): rotated in float32, rounded once, as here.
    """
    native.rotary_embedding(positions, q, k, cos, sin)


def _one_float32_or_bfloat16(x: torch.Tensor) -> bool:
    return float32_or_bfloat16((x,))


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@native_or(silu_and_mul_reference, _one_float32_or_bfloat16)
def silu_and_mul(native: ModuleType, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [..., 2F] holds gate then up; returns silu(gate) * up, [..., F].
    float32 or bfloat16 (silu(gate) rounded before the product, as the reference rounds it)."""
    return native.silu_and_mul(x)


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@native_or(gelu_tanh_and_mul_reference, _one_float32_or_bfloat16)
def gelu_tanh_and_mul(native: ModuleType, x: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation (Gemma): x [..., 2F] holds gate then up; returns
    gelu(gate, approximate="tanh") * up, [..., F], float32 or bfloat16 (rounded before the
    product, as the reference rounds it). Native computes gelu_tanh(g) as g * sigmoid(2u): the
    reference's 1 + tanh(u) cancels for gates below about -4, where native keeps the digits."""
    return native.gelu_tanh_and_mul(x)


def row_argmax_reference(x: torch.Tensor) -> torch.Tensor:
    # max's indices are argmax's, the first maximum on ties included, and over a wide row
    # max is the faster of the two.
    return x.max(dim=-1).indices


def _row_argmax_fits(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[-1] != 0 and float32_or_bfloat16((x,))


@native_or(row_argmax_reference, _row_argmax_fits)
def row_argmax(native: ModuleType, x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, [rows] int64, for x [rows, n] float32 or bfloat16:
    the first on ties, and a row's first NaN if it holds one, as torch.max gives. Greedy sampling
    takes it straight from the LM head's output: widening bfloat16 is exact, so a bfloat16 row
    needs no float32 copy to give the same token."""
    return native.row_argmax(x)
