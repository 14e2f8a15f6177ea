"""Decode attention under a key mask (a draft tree's rows, which see only their own ancestors):
native against the reference, and a masked query against attention over its visible keys alone.
The AVX2 path's side runs in tests/kernels/test_avx512.py."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import ops

from .cases import needs_native, random_paged_batch

ATTENTION_MAX_ABS_ERROR = 1e-5
# Around block boundaries, a context shorter than the mask, and past the 512-token partitions.
LENS = [1, 5, 16, 17, 40, 513, 530, 1100]
WIDTH = 9


def random_key_mask(batch: int, width: int, seed: int) -> torch.Tensor:
    """Random flags over each row's last `width` keys; the query's own key always visible."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, width, generator=gen) < 0.5
    mask[:, -1] = True
    return mask


@needs_native
@pytest.mark.parametrize("window", [None, 3, 17, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copies", [1, 4], ids=["per-kv-head", "per-sequence"])
def test_native_key_mask_matches_reference(
    window: int | None, dtype: torch.dtype, copies: int
) -> None:
    torch.manual_seed(window or 0)
    q, kv_cache, tables, lens = random_paged_batch(LENS * copies, 9, 3)
    q, kv_cache = q.to(dtype), kv_cache.to(dtype)
    mask = random_key_mask(len(lens), WIDTH, seed=copies)
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.125, window or 0, mask)
    expected = ops.paged_decode_attention_reference(
        q.float(), kv_cache.float(), tables, lens, 0.125, window, mask
    )
    tolerance = ATTENTION_MAX_ABS_ERROR if dtype == torch.float32 else 2.0**-7
    assert (out.float() - expected).abs().max().item() < tolerance


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize("window", [None, 4])
def test_a_masked_query_equals_attention_over_its_visible_keys_alone(
    native: bool, window: int | None
) -> None:
    """The keys a row hides take no weight: the same row over a cache holding only the keys it
    sees (in order) gives the same output, a window spanning the last keys it sees."""
    if native and ops.backend() != "native":
        pytest.skip("needs the native kernels")
    attend = ops._NATIVE.paged_decode_attention if native else ops.paged_decode_attention_reference
    torch.manual_seed(3)
    q, kv_cache, tables, lens = random_paged_batch([45], 4, 2, head_dim=16, block_size=8)
    mask = torch.tensor([[True, False, False, True, False, True, True, False, True]])
    out = attend(q, kv_cache, tables, lens, 0.25, window or 0, mask)
    keys, values = (ops.gather_blocks(half, tables[0])[:45] for half in kv_cache)
    seen = torch.cat([torch.ones(45 - WIDTH, dtype=torch.bool), mask[0]])
    compact = torch.stack([keys[seen], values[seen]]).view(2, 1, int(seen.sum()), 2, 16)
    alone = attend(
        q, compact, torch.zeros(1, 1, dtype=torch.long), seen.sum().view(1), 0.25, window or 0
    )
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 17])
def test_native_quantized_decode_under_a_key_mask_matches_reference(
    dtype: torch.dtype, window: int | None
) -> None:
    torch.manual_seed(5)
    q, kv_cache, tables, lens = random_paged_batch(LENS, 6, 2)
    values, scales = ops.quantize_kv_reference(kv_cache, dtype)
    mask = random_key_mask(len(lens), WIDTH, seed=7)
    out = ops._NATIVE.paged_decode_attention_quantized(
        q, values, scales, tables, lens, 0.125, window or 0, mask
    )
    expected = ops.paged_decode_attention_quantized_reference(
        q, values, scales, tables, lens, 0.125, window, mask
    )
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
def test_a_key_mask_hiding_the_querys_own_key_is_rejected() -> None:
    q, kv_cache, tables, lens = random_paged_batch([20], 2, 1)
    with pytest.raises(RuntimeError, match="own key"):
        ops._NATIVE.paged_decode_attention(
            q, kv_cache, tables, lens, 1.0, 0, torch.tensor([[True, False]])
        )
