"""ModelRunner without a model: copy-on-write block copies reach every paged KV tensor."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tokenmill.engine.runner import ModelRunner
from tokenmill.scheduler_output import SchedulerOutput


def paged_cache(seed: int) -> torch.Tensor:
    """[K/V, blocks, block_size, kv_heads, head_dim]"""
    return torch.randn(2, 6, 4, 2, 3, generator=torch.Generator().manual_seed(seed))


def test_block_copies_copy_k_and_v_in_every_layer_and_the_drafters_cache():
    layers, drafter = [paged_cache(0), paged_cache(1)], [paged_cache(2)]
    before = [cache.clone() for cache in [*layers, *drafter]]
    proposer = SimpleNamespace(own_kv_caches=drafter)  # a drafter with a paged KV of its own
    runner = ModelRunner(nn.Identity(), layers, block_size=4, proposer=proposer)
    runner.execute(SchedulerOutput(block_copies=[(1, 4), (2, 5)]))
    for cache, old in zip([*layers, *drafter], before, strict=True):
        for kv in (0, 1):  # K, then V
            assert torch.equal(cache[kv, 4], old[kv, 1])
            assert torch.equal(cache[kv, 5], old[kv, 2])
        assert torch.equal(cache[:, :4], old[:, :4])


def test_block_copies_read_every_source_before_writing():
    cache = paged_cache(3)
    old = cache.clone()
    ModelRunner(nn.Identity(), [cache], block_size=4).copy_blocks([(1, 2), (2, 3)])
    assert torch.equal(cache[:, 2], old[:, 1]) and torch.equal(cache[:, 3], old[:, 2])
