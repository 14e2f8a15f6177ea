"""Flash-style paged attention in plain PyTorch: the reference a fused kernel is checked against.

It reads each sequence's keys and values one cache block at a time through the block table and
never materialises a whole context or a whole score row, so it has the same loop structure as a
flash / paged-attention kernel while staying readable.

Why the online softmax is exact: for any constant `m`,

    softmax(s) @ V = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m),

because the factor `exp(-m)` cancels between numerator and denominator. After some tiles we hold,
for the largest score `m_old` seen so far, `l = sum_j exp(s_j - m_old)` and
`acc = sum_j exp(s_j - m_old) v_j`. When a tile raises the maximum to `m_new`, every old term
obeys `exp(s_j - m_new) = exp(s_j - m_old) * exp(m_old - m_new)`, so multiplying `l` and `acc`
by `exp(m_old - m_new)` turns them into the same sums taken against `m_new`, and the tile's own
terms are added against `m_new` directly. After the last tile `acc / l` is the full softmax
product: exact in real arithmetic, differing from the one-shot version only by rounding. Keeping
`m` at the running maximum keeps every exponent <= 0, so nothing overflows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedSequence:
    """One sequence of the flat batch: its query rows, and where its whole context is cached.

    Unlike `AttentionMetadata`, every sequence here reads its context from the cache (including
    this step's tokens), which is what a paged kernel sees.
    """

    query_start: int
    query_len: int
    seq_len: int
    block_table: Sequence[int]  # cache block ids holding positions 0, block_size, 2 * block_size...


def paged_flash_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    sequences: Sequence[PagedSequence],
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, d]; kv_cache: [2, num_blocks, block_size, kv_heads, d]. Returns [T, heads, d].

    Rows of `q` that no sequence names are left zero.
    """
    out = torch.zeros_like(q)
    for seq in sequences:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        out[rows] = _sequence_attention(q[rows], kv_cache, seq, scale)
    return out


def _sequence_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, seq: PagedSequence, scale: float
) -> torch.Tensor:
    """Online softmax over one sequence's blocks; accumulates in fp32 as a kernel would."""
    query_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    # Query head h shares KV head h // group: view heads as [kv_heads, group], never repeat K/V.
    grouped = q.float().view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    # Query row i is position seq_len - query_len + i, so it sees this many positions.
    visible = seq.seq_len - query_len + 1 + torch.arange(query_len)

    running_max = torch.full((num_kv_heads, group, query_len), float("-inf"))
    denominator = torch.zeros(num_kv_heads, group, query_len)
    acc = torch.zeros(num_kv_heads, group, query_len, head_dim)
    num_blocks = -(-seq.seq_len // block_size)
    for index, block_id in enumerate(seq.block_table[:num_blocks]):
        keys, values = (kv_cache[i, block_id].float().transpose(0, 1) for i in (0, 1))
        # keys, values: [kv_heads, block_size, d]; scores: [kv_heads, group, query_len, block]
        scores = torch.matmul(grouped, keys.transpose(-1, -2).unsqueeze(1)) * scale
        positions = index * block_size + torch.arange(block_size)
        scores = scores.masked_fill(positions[None, :] >= visible[:, None], float("-inf"))

        # Position 0 is visible to every row, so the max is finite from the first tile on.
        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        correction = torch.exp(running_max - new_max)
        weights = torch.exp(scores - new_max.unsqueeze(-1))
        denominator = denominator * correction + weights.sum(dim=-1)
        acc = acc * correction.unsqueeze(-1) + torch.matmul(weights, values.unsqueeze(1))
        running_max = new_max

    out = acc / denominator.unsqueeze(-1)
    return out.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim).to(q.dtype)
