"""Attention: a prompt's causal attention over its new positions, and decode attention (one
query token per sequence) read through a paged KV cache's block tables.

Native: prefill flash-style on AMX tiles (csrc/prefill_attention.cpp) where they run, else on
FMAs (csrc/prefill_attention_fma.cpp); decode over the cache in place with an online softmax
(csrc/paged_attention.cpp). Decode attention takes an optional key mask
over each query's last keys: a draft tree's nodes verify as decodes that see only their own
ancestors. The references run torch's SDPA; `decode_sdpa` also serves the quantized cache's
reference (`quantized_kv`).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
from torch.nn import functional as F

from tokenmill.kernels.dispatch import float32_or_bfloat16, native_or
from tokenmill.kernels.kv_store import gather_blocks

# "sdpa" keeps prompt attention on torch's SDPA (the reference) while every other kernel stays
# native: the baseline the native prefill kernels are measured against. Read once, at import.
PREFILL_ATTENTION_ENV = "TOKENMILL_PREFILL_ATTENTION"
NATIVE_PREFILL_ATTENTION = os.environ.get(PREFILL_ATTENTION_ENV, "native").strip().lower() != "sdpa"


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """torch's SDPA: its causal kernel when the query is the whole context and no window hides
    keys, else an explicit mask."""
    q_len, kv_len = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    windowed = window is not None and window < kv_len
    if q_len == kv_len and not windowed:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        offset = kv_len - q_len
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=offset)
        if windowed:
            allowed = allowed.triu(diagonal=offset - window + 1)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention under an explicit mask: q [n, H, d], k and v [S, kv_heads, d], `allowed`
    [n, S] bool (a draft tree's queries, which see their ancestors rather than every earlier
    key). torch's SDPA, in float32 like the decode kernel; GQA by head groups."""
    qh, kh, vh = (t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


def _prefill_attention_fits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> bool:
    if not (NATIVE_PREFILL_ATTENTION and float32_or_bfloat16((q, k, v))):
        return False
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        return False
    head_dim = q.shape[2]
    return (
        head_dim <= 256
        and k.shape[2] == head_dim
        and q.shape[1] % k.shape[1] == 0
        and 1 <= q.shape[0] <= k.shape[0]
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
    )


@native_or(prefill_attention_reference, _prefill_attention_fits)
def prefill_attention(
    native: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a prompt's new positions: q [n, H, d] holds the last n of the S
    positions whose keys and values are k and v [S, kv_heads, d]; GQA by head groups. With a
    sliding `window`, each position also sees only itself and the `window - 1` before it.

    Native where each position's heads are contiguous, of a head_dim up to 256, in float32 or
    bfloat16: a bfloat16 model's on AMX tiles (csrc/prefill_attention.cpp) where the CPU has them
    and the head_dim is a multiple of 32, everything else on float32 FMAs, bfloat16 widened
    (csrc/prefill_attention_fma.cpp). Anything else, or `TOKENMILL_PREFILL_ATTENTION=sdpa`, runs
    torch's SDPA."""
    return native.prefill_attention(q, k, v, scale, window or 0)


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched SDPA. The query heads sharing a KV head
    are passed as that head's "query positions", so grouped-query attention never repeats K/V."""
    keys, values = (gather_blocks(cache, block_tables) for cache in kv_cache)
    return decode_sdpa(q, keys, values, seq_lens, scale, window, key_mask)


def _paged_decode_attention_fits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> bool:
    return kv_cache.is_contiguous() and float32_or_bfloat16((q, kv_cache))


@native_or(paged_decode_attention_reference, _paged_decode_attention_fits)
def paged_decode_attention(
    native: ModuleType,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, attending over its first `seq_lens[b]` cached positions,
    or with a sliding `window` over only the last `window` of them (Gemma 3's local layers).
    `key_mask` (bool [B, width]): row b hides the keys among its last `width` whose flag is
    clear (a draft tree's other branches; its last flag, the query's own key, must be set); a
    window then spans the last `window` keys the row sees.

    q: [B, H, d]; kv_cache: [2, num_blocks, block_size, kv_heads, d] (K then V);
    block_tables: [B, max_blocks] int32/int64; seq_lens: [B] ints in [1, max_blocks * block_size].
    Returns [B, H, d]. Native reads K and V in place through the block tables (no gather copy);
    a bfloat16 model's q and cache too, computing in float32 and rounding the output once.
    """
    return native.paged_decode_attention(
        q, kv_cache, block_tables, seq_lens, scale, window or 0, key_mask
    )


def decode_sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode references' attention once K and V are gathered, `[B * max_blocks *
    block_size, kv_heads, d]` each: every sequence's first seq_lens[b] rows, less those its
    `key_mask` row hides (its last `window` of them)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[-2]
    keys, values = (
        t.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2) for t in (keys, values)
    )  # [B, kv_heads, max_blocks * block_size, d]
    position = torch.arange(keys.shape[2])
    lens = seq_lens.reshape(-1, 1).cpu()
    inside = position < lens  # [B, L], True = attend
    if key_mask is not None:
        width = key_mask.shape[1]
        masked = (position >= lens - width) & inside
        offset = (position - (lens - width)).clamp(0, width - 1)
        inside &= ~masked | key_mask.cpu().gather(1, offset)
    if window:  # the last `window` keys each row sees
        seen_from_end = inside.flip(1).cumsum(1).flip(1)
        inside &= seen_from_end <= window
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=inside[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)
