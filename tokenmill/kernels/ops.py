"""The one dispatch for compute kernels: native AVX2/OpenMP code when it loads, torch otherwise.

Every kernel has a pure-PyTorch reference (`*_reference`) that the tests compare against and that
runs whenever the native extension is switched off (`TOKENMILL_KERNELS=torch`), failed to load
(one warning line on stderr, never a crash), or does not cover the inputs (not float32, autograd,
or a batch too wide for the skinny kernel).
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
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
        _warn(
            f"native kernels unavailable ({reason}); using the torch reference kernels "
            "(details: python scripts/build_kernels.py)"
        )
        return None


_NATIVE = _load_native()


def backend() -> str:
    """ "native" when the extension is in use, "torch" when every op runs its reference."""
    return "torch" if _NATIVE is None else "native"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (x: [..., K], weight: [N, K], bias: [N]); native when x has <= 16 rows."""
    if _NATIVE is None or not _skinny_linear_fits(x, weight, bias):
        return linear_reference(x, weight, bias)
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
) -> torch.Tensor:
    """One query token per sequence, attending over its first `seq_lens[b]` cached positions.

    q: [B, H, d]; kv_cache: [2, num_blocks, block_size, kv_heads, d] (K then V);
    block_tables: [B, max_blocks] int32/int64; seq_lens: [B] ints in [1, max_blocks * block_size].
    Returns [B, H, d]. Native reads K and V in place through the block tables (no gather copy).
    """
    if _NATIVE is None or not (kv_cache.is_contiguous() and _native_friendly((q, kv_cache))):
        return paged_decode_attention_reference(q, kv_cache, block_tables, seq_lens, scale)
    return _NATIVE.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The model's own gather-then-SDPA path, with the length mask it expects."""
    # Imported here: the model will import this module, so a top-level import would be circular.
    from tokenmill.model.attention import decode_attention

    block_size = kv_cache.shape[2]
    span = torch.arange(block_tables.shape[1] * block_size)
    mask = torch.zeros(len(seq_lens), span.numel(), dtype=q.dtype)
    mask.masked_fill_(span[None, :] >= seq_lens.reshape(-1, 1).cpu(), float("-inf"))
    return decode_attention(q, kv_cache, block_tables.long(), mask, scale)


def _native_friendly(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Float32 CPU tensors outside autograd: the only case the native kernels implement."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    on_cpu_fp32 = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
    return on_cpu_fp32 and not needs_grad
