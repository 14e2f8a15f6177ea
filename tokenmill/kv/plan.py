"""The KV memory math, before any tensor exists: what one pool block holds, how many blocks a
sequence needs in each KV-cache group, and so how many tokens and full-length requests a pool
of a given size holds, with window trimming and without (`tokenmill kv-plan`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import ModelConfig
from tokenmill.kv.groups import KVGroups, kv_groups
from tokenmill.kv.layout import kv_block_bytes, kv_bytes_per_token


def group_blocks_for_tokens(
    window: int | None, block_size: int, num_tokens: int, chunk_tokens: int = 1
) -> int:
    """The most blocks one group holds for a sequence of `num_tokens` computing `chunk_tokens`
    at a time: all of them, or with a window w, those the w - 1 positions before a chunk and
    the chunk span (at most ceil((w + chunk - 2) / block_size) + 1: 33 for w = 512, a decode's
    chunk of 1 and blocks of 16)."""
    num_blocks = -(-num_tokens // block_size)
    if window is None:
        return num_blocks
    return min(num_blocks, -(-(window + chunk_tokens - 2) // block_size) + 1)


def blocks_for_tokens(
    groups: KVGroups, block_size: int, num_tokens: int, chunk_tokens: int = 1
) -> int:
    return sum(
        group_blocks_for_tokens(window, block_size, num_tokens, chunk_tokens)
        for window in groups.windows
    )


@dataclass(frozen=True)
class KVPlan:
    groups: KVGroups
    block_size: int
    block_bytes: int  # one pool block: block_size tokens in one group's layers
    num_blocks: int  # blocks a request can hold (a trimming pool's null block left out)
    max_model_len: int

    @property
    def blocks_per_request(self) -> int:
        """Blocks a max_model_len request holds at its end."""
        return blocks_for_tokens(self.groups, self.block_size, self.max_model_len)

    @property
    def full_length_requests(self) -> int:
        return self.num_blocks // self.blocks_per_request

    @property
    def bytes_per_token(self) -> int:
        """Of a max_model_len request, averaged over its tokens."""
        return self.blocks_per_request * self.block_bytes // self.max_model_len


def kv_plan(
    config: ModelConfig,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    block_size: int,
    kv_cache_memory: int,
    max_model_len: int,
    window_trimming: bool,
) -> KVPlan:
    groups = kv_groups(config, window_trimming)
    block_bytes = kv_block_bytes(config, dtype, block_size, kv_cache_dtype, groups)
    num_blocks = kv_cache_memory // block_bytes - (1 if groups.trims else 0)
    return KVPlan(groups, block_size, block_bytes, max(num_blocks, 0), max_model_len)


def layer_bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """K and V of one token in one layer."""
    return kv_bytes_per_token(config, dtype, kv_cache_dtype) // config.num_hidden_layers
