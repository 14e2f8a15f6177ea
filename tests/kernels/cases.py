"""Helpers the kernel tests share: the skip mark for native-only tests, the error measure, and
random paged-attention batches."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import ops

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def random_paged_batch(
    seq_lens: list[int], heads: int, kv_heads: int, head_dim: int = 64, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, a cache with spare blocks, shuffled (non-contiguous) block tables, and lengths."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    shuffled = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.long)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor([shuffled.pop() for _ in range(count)])
    q = torch.randn(len(seq_lens), heads, head_dim)
    return q, kv_cache, tables, torch.tensor(seq_lens)
