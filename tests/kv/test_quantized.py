"""The quantized KV cache object: its layout and bytes, block copies, and `attention()` over it,
which must equal exact attention over the keys and values the cache rounded them to."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import ops
from tokenmill.kv.quantized import (
    KV_STORAGE_DTYPES,
    QuantizedKVCache,
    allocate_kv_cache,
    copy_cache_blocks,
    kv_head_bytes,
)
from tokenmill.model.attention import AttentionMetadata, attention, gather_context

KV_DTYPES = ["int8", "fp8"]
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


def test_allocation_is_codes_and_fp32_scales_per_token_and_head() -> None:
    cache = allocate_kv_cache("fp8", 5, 4, 2, HEAD_DIM, torch.float32)
    assert isinstance(cache, QuantizedKVCache)
    assert cache.values.shape == (2, 5, 4, 2, HEAD_DIM)
    assert cache.values.dtype == torch.float8_e4m3fn
    assert cache.scales.shape == (2, 5, 4, 2) and cache.scales.dtype == torch.float32
    plain = allocate_kv_cache("auto", 5, 4, 2, HEAD_DIM, torch.bfloat16)
    assert isinstance(plain, torch.Tensor) and plain.dtype == torch.bfloat16


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_bytes_per_head_count_codes_and_scale(kv_cache_dtype: str) -> None:
    assert kv_head_bytes(kv_cache_dtype, 64, torch.float32) == 64 + 4
    assert kv_head_bytes("auto", 64, torch.float32) == 256
    assert kv_head_bytes("auto", 64, torch.bfloat16) == 128
    cache = allocate_kv_cache(kv_cache_dtype, 3, 16, 1, 64, torch.float32)
    per_token = (cache.values.nbytes + cache.scales.nbytes) // (3 * 16 * 2)
    assert per_token == kv_head_bytes(kv_cache_dtype, 64, torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", [*KV_DTYPES, "auto"])
def test_copy_blocks_moves_codes_and_scales_of_exactly_the_named_blocks(
    kv_cache_dtype: str,
) -> None:
    torch.manual_seed(0)
    cache = allocate_kv_cache(kv_cache_dtype, 6, 4, 2, HEAD_DIM, torch.float32)
    slots = torch.arange(24)
    k, v = torch.randn(24, 2, HEAD_DIM), torch.randn(24, 2, HEAD_DIM)
    if isinstance(cache, QuantizedKVCache):
        cache.store(slots, k, v)
    else:
        ops.store_kv(cache, slots, k, v)
    before = [gather_context(cache, torch.tensor([b]), 4) for b in range(6)]
    copy_cache_blocks(cache, torch.tensor([1, 4]), torch.tensor([4, 0]))  # 4 is read first
    after = [gather_context(cache, torch.tensor([b]), 4) for b in range(6)]
    expected = [before[4], before[1], before[2], before[3], before[1], before[5]]
    for got, want in zip(after, expected, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def rounded(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """x as a quantized cache gives it back."""
    return ops.dequantize_kv_reference(
        *ops.quantize_kv_reference(x, KV_STORAGE_DTYPES[kv_cache_dtype])
    )


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q: the last len(q) of len(k) positions; every KV head shared by heads // kv_heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    last = k.shape[0] - q.shape[0] + torch.arange(q.shape[0])
    allowed = torch.arange(k.shape[0])[None, :] <= last[:, None]
    if window is not None:
        allowed &= torch.arange(k.shape[0])[None, :] > last[:, None] - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), v)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [None, 6])
def test_attention_over_a_quantized_cache_is_exact_attention_over_its_rounded_kv(
    kv_cache_dtype: str, window: int | None
) -> None:
    """One batch of a whole prompt, a long chunk over a cached context (gathered and
    dequantized), a short chunk and a decode (the native decode path), GQA 6:2, blocks of 4.
    Cached positions come back rounded; a whole prompt attends over its exact K/V."""
    torch.manual_seed(1)
    heads, kv_heads, block_size = 6, 2, 4
    shapes = [(9, 9), (20, 31), (3, 14), (1, 17)]  # (query_len, seq_len)
    tables = [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18, 19]]
    cache = allocate_kv_cache(kv_cache_dtype, 21, block_size, kv_heads, HEAD_DIM, torch.float32)
    keys = [torch.randn(s, kv_heads, HEAD_DIM) for _, s in shapes]
    values = [torch.randn(s, kv_heads, HEAD_DIM) for _, s in shapes]

    def slots(table: list[int], start: int, stop: int) -> list[int]:
        return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]

    for (n, s), table, k, v in zip(shapes, tables, keys, values, strict=True):
        cached = torch.tensor(slots(table, 0, s - n), dtype=torch.long)
        cache.store(cached, k[: s - n], v[: s - n])
    meta = AttentionMetadata.build(
        [n for n, _ in shapes],
        [s for _, s in shapes],
        tables,
        block_size,
        [slot for (n, s), t in zip(shapes, tables, strict=True) for slot in slots(t, s - n, s)],
    )
    q = torch.randn(sum(n for n, _ in shapes), heads, HEAD_DIM)
    new_k = torch.cat([k[s - n :] for (n, s), k in zip(shapes, keys, strict=True)])
    new_v = torch.cat([v[s - n :] for (n, s), v in zip(shapes, values, strict=True)])
    out = attention(q, new_k, new_v, cache, meta, SCALE, window)

    start = 0
    for (n, s), k, v in zip(shapes, keys, values, strict=True):
        if n < s:
            k, v = rounded(k, kv_cache_dtype), rounded(v, kv_cache_dtype)
        expected = exact_attention(q[start : start + n], k, v, window)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
        start += n
