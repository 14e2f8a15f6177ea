"""The one dispatch for compute kernels: native AVX2/OpenMP code when it loads, torch otherwise.

Every kernel has a pure-PyTorch reference (`*_reference`) that the tests compare against and that
runs whenever the native extension is switched off (`TOKENMILL_KERNELS=torch`), failed to load
(one warning line on stderr, never a crash), or does not cover the inputs (not float32, autograd,
a batch too wide for the skinny kernel, or a layout an in-place kernel cannot write through).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch
from torch.nn import functional as F

from tokenmill.kernels import build

BACKEND_ENV = "TOKENMILL_KERNELS"
# Above this many rows of x, MKL's blocked GEMM beats a kernel that streams the weights once.
SKINNY_MAX_ROWS = 16


def _warn(message: str) -> None:
    print(f"tokenmill: {message}", file=sys.stderr)


def _load_native() -> ModuleType | None:
    """The extension module, or None when the torch reference should run."""
    choice = os.environ.get(BACKEND_ENV, "native").strip().lower()
    if choice == "torch":
        return None
    if choice != "native":
        _warn(f"{BACKEND_ENV}={choice!r} is neither 'native' nor 'torch'; trying native")
    # The kernels are compiled for AVX2 + FMA; on an older CPU they would die on SIGILL.
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _warn("native kernels need AVX2; using the torch reference kernels")
        return None
    try:
        return build.load_extension()
    except Exception as exc:  # any build or load failure must leave a working engine
        first_line = str(exc).strip().partition("\n")[0][:160]
        reason = f"{type(exc).__name__}: {first_line}"
        _warn(
            f"native kernels unavailable ({reason}); using the torch reference kernels "
            "(details: python scripts/build_kernels.py)"
        )
        return None


_NATIVE = _load_native()


def backend() -> str:
    """Which kernels run: "native" (the extension) or "torch" (every op's reference)."""
    return "torch" if _NATIVE is None else "native"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (x: [..., K], weight: [N, K], bias: [N]); native when x has <= 16 rows."""
    if _NATIVE is None or not _skinny_linear_fits(x, weight, bias):
        return linear_reference(x, weight, bias)
    if x.dim() == 2:  # the usual flat batch; reshaping costs more than the kernel call itself
        return _NATIVE.linear(x, weight, bias)
    out = _NATIVE.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _skinny_linear_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        x.dim() >= 1
        and x.shape[-1] > 0
        and x.numel() <= SKINNY_MAX_ROWS * x.shape[-1]
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
        and _native_friendly(tensors)
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, attending over its first `seq_lens[b]` cached positions,
    or with a sliding `window` over only the last `window` of them (Gemma 3's local layers).

    q: [B, H, d]; kv_cache: [2, num_blocks, block_size, kv_heads, d] (K then V);
    block_tables: [B, max_blocks] int32/int64; seq_lens: [B] ints in [1, max_blocks * block_size].
    Returns [B, H, d]. Native reads K and V in place through the block tables (no gather copy).
    """
    if _NATIVE is None or not (kv_cache.is_contiguous() and _native_friendly((q, kv_cache))):
        return paged_decode_attention_reference(q, kv_cache, block_tables, seq_lens, scale, window)
    return _NATIVE.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, window or 0)


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched SDPA. The query heads sharing a KV head
    are passed as that head's "query positions", so grouped-query attention never repeats K/V."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    keys, values = (
        gather_blocks(cache, block_tables).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        for cache in kv_cache
    )  # [B, kv_heads, max_blocks * block_size, d]
    position = torch.arange(keys.shape[2])
    lens = seq_lens.reshape(-1, 1).cpu()
    inside = position < lens  # [B, L], True = attend
    if window:
        inside &= position >= lens - window
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=inside[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows of one cache half ([num_blocks, block_size, kv_heads, d]) for the given blocks, as
    `[block_ids.numel() * block_size, kv_heads, d]`; index_select on the flattened blocks is
    several times faster than advanced indexing here."""
    flat = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1).long())
    return flat.view(-1, *cache.shape[-2:])


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `residual + x` (of `x` alone when residual is None) fused with that add.

    x, residual: [..., D]; weight: [D]. Returns (normed, new_residual); normed is a new tensor.
    On both backends the sum is written into `residual` in place and new_residual *is* that
    tensor (or `x` itself when residual is None), so the caller just rebinds its residual.
    """
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if _NATIVE is None or not (
        (residual is None or residual.is_contiguous()) and _native_friendly(tensors)
    ):
        return add_rms_norm_reference(x, residual, weight, eps)
    return _NATIVE.add_rms_norm(x, residual, weight, eps), x if residual is None else residual


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        residual = x
    else:
        residual.add_(x)
    return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual


def rotary_embedding(
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
    through any token and head stride as long as each head's d values are contiguous.
    """
    if _NATIVE is None or not (
        positions.dtype == torch.int64
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and _native_friendly((q, k, cos, sin))
    ):
        rotary_embedding_reference(positions, q, k, cos, sin)
        return
    _NATIVE.rotary_embedding(positions, q, k, cos, sin)


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [..., 2F] holds gate then up; returns silu(gate) * up, [..., F]."""
    if _NATIVE is None or not _native_friendly((x,)):
        return silu_and_mul_reference(x)
    return _NATIVE.silu_and_mul(x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _native_friendly(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Float32 CPU tensors outside autograd: the only case the native kernels implement.

    Runs on every call, so it sticks to the cheapest tensor attributes (`is_cpu`, not `device`).
    """
    grad_enabled = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or (grad_enabled and t.requires_grad):
            return False
    return True
