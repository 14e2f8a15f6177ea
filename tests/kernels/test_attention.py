"""Native paged decode attention against the gather-then-SDPA reference, and the reference's
sliding window against a softmax written out by hand."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.kernels import ops

from .cases import needs_native, random_paged_batch

# Both sides accumulate in float32 in different orders: they differ by rounding only.
ATTENTION_MAX_ABS_ERROR = 1e-5


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(6, 6), (9, 3), (8, 1)], ids=["mha", "gqa3", "all-to-one"]
)
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_native_paged_attention_matches_gather_path(heads: int, kv_heads: int, batch: int) -> None:
    torch.manual_seed(batch * heads)
    edge_lens = [15, 16, 17, 1, 32, 33, 100]  # around block boundaries, then multi-block
    seq_lens = [
        edge_lens[i] if i < len(edge_lens) else random.randint(1, 200) for i in range(batch)
    ]
    q, kv_cache, tables, lens = random_paged_batch(seq_lens, heads, kv_heads)
    scale = q.shape[-1] ** -0.5
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, scale)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, scale)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 500])
@pytest.mark.parametrize("copies", [1, 2], ids=["7-sequences", "14-sequences"])
def test_native_paged_attention_sliding_window_matches_reference(window: int, copies: int) -> None:
    """With 2 threads, 7 sequences run as one work item per KV head, 14 as one per sequence."""
    torch.manual_seed(window)
    q, kv_cache, tables, lens = random_paged_batch([1, 15, 16, 17, 33, 100, 190] * copies, 4, 2)
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.2, window)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.2, window)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [(9, 3, 64, 16, None), (4, 1, 256, 16, 512), (6, 2, 64, 32, 700), (8, 1, 64, 8, None)],
    ids=["smollm2", "gemma3-local", "blocks-of-32", "blocks-of-8"],
)
@pytest.mark.parametrize("copies", [1, 8], ids=["one-per-kv-head", "one-per-sequence"])
def test_native_paged_attention_merges_a_long_context_in_partitions(
    heads: int, kv_heads: int, head_dim: int, block_size: int, window: int | None, copies: int
) -> None:
    """Contexts past 512 tokens run in 512-token partitions whose sums merge at the end: one
    token past the first cut, several cuts, one just short of a cut. 1 copy runs each
    partition of each KV head as its own work item, 8 copies (2 threads) a sequence per item."""
    torch.manual_seed(head_dim + block_size)
    q, kv_cache, tables, lens = random_paged_batch(
        [513, 1500, 1024, 2047, 100] * copies, heads, kv_heads, head_dim, block_size
    )
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.125, window or 0)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.125, window)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
def test_native_paged_attention_gives_a_long_context_the_same_bits_alone_and_in_a_batch() -> None:
    """Partitions are cut by a sequence's own length, never by the batch's size, so a request
    decodes identically alone (a work item per partition) and beside 15 others (per sequence)."""
    torch.manual_seed(4)
    q, kv_cache, tables, lens = random_paged_batch(
        [3000, *torch.randint(1, 2500, (15,)).tolist()], 9, 3
    )
    full = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.125)
    for row in range(len(lens)):
        alone = ops._NATIVE.paged_decode_attention(
            q[row : row + 1], kv_cache, tables[row : row + 1], lens[row : row + 1], 0.125
        )
        assert torch.equal(alone[0], full[row])


def test_sliding_window_reference_attends_to_exactly_the_last_positions() -> None:
    """Against a softmax written out by hand over the window's keys alone."""
    torch.manual_seed(1)
    q, kv_cache, tables, lens = random_paged_batch([37], 2, 1, head_dim=8, block_size=4)
    out = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.5, window=10)
    keys, values = (ops.gather_blocks(half, tables[0])[27:37, 0] for half in kv_cache)
    weights = torch.softmax(q[0] @ keys.T * 0.5, dim=-1)
    torch.testing.assert_close(out[0], weights @ values)


@needs_native
def test_native_paged_attention_accepts_int32_tables_and_odd_head_dim() -> None:
    torch.manual_seed(0)
    q, kv_cache, tables, lens = random_paged_batch([5, 12, 3], 4, 2, head_dim=13, block_size=5)
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables.int(), lens.int(), 0.3)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.3)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
def test_native_paged_attention_rejects_lengths_past_the_block_table() -> None:
    q, kv_cache, tables, _ = random_paged_batch([16], 2, 1)
    with pytest.raises(RuntimeError, match="outside"):
        ops._NATIVE.paged_decode_attention(q, kv_cache, tables, torch.tensor([17]), 1.0)


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(8, 2, 256), (9, 3, 64), (10, 2, 80), (6, 3, 48)],
    ids=["group4-dim256", "group3-dim64", "group5-dim80", "group2-dim48"],
)
def test_native_paged_attention_reads_a_bfloat16_cache_for_any_group(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """Groups of 4, 3, 5 (4 + 1) and 2 query heads, whose scores the AVX-512 path reduces a run
    of up to 4 heads at a time: each the float32 attention over the same values, rounded once."""
    torch.manual_seed(head_dim)
    q, kv_cache, tables, lens = random_paged_batch(
        [1, 17, 100, 700] * 2, heads, kv_heads, head_dim=head_dim
    )
    q, kv_cache = q.bfloat16(), kv_cache.bfloat16()
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.1, 0)
    exact = ops.paged_decode_attention_reference(q.float(), kv_cache.float(), tables, lens, 0.1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=1e-2)
