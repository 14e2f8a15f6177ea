"""Paged attention, both the engine's and the online-softmax reference, against naive attention.

The naive oracle materialises every score with an explicit causal mask and repeated KV heads.
Batches place each sequence in shuffled, non-contiguous cache blocks and fill every slot no
sequence owns with large garbage, so reading past a context or outside a block table shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tokenmill.model.attention import MAX_DECODE_QUERY, AttentionMetadata, attention
from tokenmill.model.flash_reference import PagedSequence, paged_flash_attention

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5
# (query heads, kv heads): MHA, groups of 3, MQA.
HEAD_LAYOUTS = [(4, 4), (6, 2), (5, 1)]
HEAD_IDS = ["mha", "gqa3", "mqa"]


def assert_matches_naive(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """q: [n, heads, d] holds the last n of the len(k) positions; k, v: [L, kv_heads, d].
    A sliding `window` keeps only the last `window` positions up to each query's own."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    limit = seq_len - query_len + 1 + torch.arange(query_len)
    allowed = torch.arange(seq_len)[None, :] < limit[:, None]
    if window is not None:
        allowed &= torch.arange(seq_len)[None, :] >= limit[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@dataclass
class PagedBatch:
    """A flat batch of sequences, each with its whole context's K/V and its cache placement."""

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, d]
    values: list[torch.Tensor]
    q: torch.Tensor  # [T, heads, d]
    kv_cache: torch.Tensor  # holds each context before this step's tokens, garbage elsewhere

    def new_rows(self, contexts: list[torch.Tensor]) -> torch.Tensor:
        """The last query_len positions of each sequence, laid end to end."""
        parts = [
            c[s - n :] for c, n, s in zip(contexts, self.query_lens, self.seq_lens, strict=True)
        ]
        return torch.cat(parts)

    def slots(self, start: int, stop: int, table: list[int]) -> list[int]:
        return [
            table[p // self.block_size] * self.block_size + p % self.block_size
            for p in range(start, stop)
        ]

    def slot_mapping(self) -> list[int]:
        out: list[int] = []
        for n, s, table in zip(self.query_lens, self.seq_lens, self.block_tables, strict=True):
            out += self.slots(s - n, s, table)
        return out

    def cache_new_tokens(self) -> None:
        """Store this step's K/V directly, as if a previous write had already happened."""
        flat = self.kv_cache.view(2, -1, *self.kv_cache.shape[-2:])
        slots = torch.tensor(self.slot_mapping())
        flat[0, slots] = self.new_rows(self.keys)
        flat[1, slots] = self.new_rows(self.values)

    def query_starts(self) -> list[int]:
        return torch.tensor([0, *self.query_lens[:-1]]).cumsum(0).tolist()

    def sequences(self) -> list[PagedSequence]:
        return [
            PagedSequence(start, n, s, table)
            for start, n, s, table in zip(
                self.query_starts(), self.query_lens, self.seq_lens, self.block_tables, strict=True
            )
        ]

    def naive(self, window: int | None = None) -> torch.Tensor:
        return torch.cat(
            [
                naive_attention(self.q[start : start + n], k, v, window)
                for start, n, k, v in zip(
                    self.query_starts(), self.query_lens, self.keys, self.values, strict=True
                )
            ]
        )


def make_batch(
    shapes: list[tuple[int, int]], heads: tuple[int, int], block_size: int = 4
) -> PagedBatch:
    """shapes: (query_len, seq_len) per sequence, with random queries, keys and values."""
    num_heads, num_kv_heads = heads
    q = torch.randn(sum(n for n, _ in shapes), num_heads, HEAD_DIM)
    keys = [torch.randn(s, num_kv_heads, HEAD_DIM) for _, s in shapes]
    values = [torch.randn(s, num_kv_heads, HEAD_DIM) for _, s in shapes]
    return place_in_cache(q, keys, values, [n for n, _ in shapes], block_size)


def place_in_cache(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_lens: list[int],
    block_size: int,
) -> PagedBatch:
    """Deal blocks from a shuffled pool and cache each context up to this step's tokens."""
    seq_lens = [len(k) for k in keys]
    needed = [-(-s // block_size) for s in seq_lens]
    pool = torch.randperm(sum(needed) + 3).tolist()  # three blocks nobody owns
    tables = []
    for count in needed:
        tables.append(pool[:count])
        pool = pool[count:]
    kv_cache = 100 * torch.randn(2, sum(needed) + 3, block_size, *keys[0].shape[1:])
    batch = PagedBatch(query_lens, seq_lens, tables, block_size, keys, values, q, kv_cache)
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    for n, s, table, k, v in zip(query_lens, seq_lens, tables, keys, values, strict=True):
        cached = torch.tensor(batch.slots(0, s - n, table), dtype=torch.long)
        flat[0, cached] = k[: s - n]
        flat[1, cached] = v[: s - n]
    return batch


def random_shapes(count: int, max_len: int) -> list[tuple[int, int]]:
    """Mixed query lens: decodes, chunks continuing a cached context, and whole prompts."""
    shapes = []
    for _ in range(count):
        seq_len = int(torch.randint(1, max_len + 1, ()))
        kind = int(torch.randint(0, 3, ()))
        query_len = [1, int(torch.randint(1, seq_len + 1, ())), seq_len][kind]
        shapes.append((query_len, seq_len))
    return shapes


def run_attention(batch: PagedBatch, window: int | None = None) -> torch.Tensor:
    meta = AttentionMetadata.build(
        batch.query_lens,
        batch.seq_lens,
        batch.block_tables,
        batch.block_size,
        batch.slot_mapping(),
    )
    k, v = batch.new_rows(batch.keys), batch.new_rows(batch.values)
    return attention(batch.q, k, v, batch.kv_cache, meta, SCALE, window)


def run_flash(batch: PagedBatch) -> torch.Tensor:
    batch.cache_new_tokens()
    return paged_flash_attention(batch.q, batch.kv_cache, batch.sequences(), SCALE)


# Block size 4: seq lens 3, 4, 5 straddle the first boundary; the rest span several blocks.
MIXED_SHAPES = [(1, 3), (1, 4), (1, 5), (5, 5), (3, 11), (4, 12), (13, 13), (1, 17), (6, 9)]


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_flash_reference_matches_naive_for_mixed_query_lens(heads: tuple[int, int]):
    torch.manual_seed(0)
    batch = make_batch(MIXED_SHAPES, heads)
    assert_matches_naive(run_flash(batch), batch.naive())


@pytest.mark.parametrize("seq_len", [3, 4, 5, 8, 9, 14])
@pytest.mark.parametrize("query_len", ["decode", "prompt"])
def test_flash_reference_matches_naive_around_block_boundaries(seq_len: int, query_len: str):
    torch.manual_seed(1)
    n = 1 if query_len == "decode" else seq_len
    batch = make_batch([(n, seq_len)], (6, 2), block_size=4)
    assert_matches_naive(run_flash(batch), batch.naive())


def test_flash_reference_matches_naive_on_random_batches():
    torch.manual_seed(2)
    for _ in range(20):
        heads = HEAD_LAYOUTS[int(torch.randint(0, len(HEAD_LAYOUTS), ()))]
        block_size = [1, 2, 4, 16][int(torch.randint(0, 4, ()))]
        batch = make_batch(random_shapes(5, 40), heads, block_size)
        assert_matches_naive(run_flash(batch), batch.naive())


def test_flash_reference_rescales_when_a_later_block_holds_a_far_larger_score():
    torch.manual_seed(3)
    q = torch.randn(1, 2, HEAD_DIM)
    keys, values = torch.randn(12, 1, HEAD_DIM), torch.randn(12, 1, HEAD_DIM)
    # Keys along query head 0 in the last block: scores near 110, where a bare exp overflows.
    keys[8:] = 40 * q[0, 0] + torch.randn(4, 1, HEAD_DIM)
    batch = place_in_cache(q, [keys], [values], [1], block_size=4)
    assert_matches_naive(run_flash(batch), batch.naive())


def test_flash_reference_does_not_depend_on_which_blocks_hold_the_context():
    torch.manual_seed(4)
    batch = make_batch([(3, 10), (1, 7)], (6, 2))
    moved = place_in_cache(batch.q, batch.keys, batch.values, batch.query_lens, 4)
    assert moved.block_tables != batch.block_tables
    torch.testing.assert_close(run_flash(moved), run_flash(batch), rtol=0, atol=1e-6)


# A fresh prompt (context == query), a chunk continuing a cached context, a one-token prompt,
# and decodes whose contexts end just before, at and after a block boundary and several blocks in.
ENGINE_SHAPES = [(7, 7), (5, 13), (1, 1), (1, 3), (1, 4), (1, 5), (1, 14), (4, 8)]


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_attention_matches_naive_for_mixed_prefill_chunk_and_decode_batch(
    heads: tuple[int, int],
):
    torch.manual_seed(5)
    batch = make_batch(ENGINE_SHAPES, heads)
    assert_matches_naive(run_attention(batch), batch.naive())


def test_attention_matches_naive_on_random_batches():
    torch.manual_seed(6)
    for _ in range(20):
        heads = HEAD_LAYOUTS[int(torch.randint(0, len(HEAD_LAYOUTS), ()))]
        block_size = [1, 2, 4, 16][int(torch.randint(0, 4, ()))]
        batch = make_batch(random_shapes(5, 40), heads, block_size)
        assert_matches_naive(run_attention(batch), batch.naive())


@pytest.mark.parametrize("window", [1, 3, 4, 6, 20])
def test_sliding_window_attention_matches_naive(window: int):
    """Prefills, chunks and decodes whose contexts are shorter and longer than the window."""
    torch.manual_seed(window)
    batch = make_batch([*ENGINE_SHAPES, (1, 17), (3, 19)], (6, 2))
    assert_matches_naive(run_attention(batch, window), batch.naive(window))


def test_short_chunks_over_a_cached_context_attend_token_by_token_as_decodes():
    """Speculative drafts being verified: each token of a chunk of up to MAX_DECODE_QUERY
    tokens is a decode over the context up to itself; a longer chunk stays a prefill segment."""
    torch.manual_seed(7)
    batch = make_batch([(5, 21), (MAX_DECODE_QUERY, 40), (MAX_DECODE_QUERY + 1, 40)], (6, 2))
    meta = AttentionMetadata.build(
        batch.query_lens,
        batch.seq_lens,
        batch.block_tables,
        batch.block_size,
        batch.slot_mapping(),
    )
    assert meta.decode is not None
    assert meta.decode.seq_lens.tolist() == [*range(17, 22), *range(25, 41)]
    assert [segment.query_len for segment in meta.prefills] == [MAX_DECODE_QUERY + 1]
    assert_matches_naive(run_attention(batch), batch.naive())


def test_attention_stores_the_step_tokens_in_their_slots():
    torch.manual_seed(7)
    batch = make_batch(ENGINE_SHAPES, (6, 2))
    run_attention(batch)
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[-2:])
    slots = torch.tensor(batch.slot_mapping())
    assert torch.equal(flat[0, slots], batch.new_rows(batch.keys))
    assert torch.equal(flat[1, slots], batch.new_rows(batch.values))


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_attention_without_cache_attends_each_sequence_over_its_query(heads: tuple[int, int]):
    torch.manual_seed(8)
    shapes = [(s, s) for s in (1, 5, 9, 2)]
    batch = make_batch(shapes, heads)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, None, 4, None)
    k, v = torch.cat(batch.keys), torch.cat(batch.values)
    assert_matches_naive(attention(batch.q, k, v, None, meta, SCALE), batch.naive())
