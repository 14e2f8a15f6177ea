"""Writes into the paged KV cache land in exactly the named slots, on both backends."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import ops

from .cases import needs_native

STORE_KV_BACKENDS = [
    pytest.param(ops.store_kv_reference, id="reference"),
    pytest.param(lambda *args: ops._NATIVE.store_kv(*args), id="native", marks=needs_native),
]


@pytest.mark.parametrize("store", STORE_KV_BACKENDS)
def test_store_kv_writes_exactly_the_named_slots(store) -> None:
    """k and v are column slices of one merged projection, as the model hands them over."""
    torch.manual_seed(9)
    kv_heads, head_dim, block_size = 2, 8, 4
    kv_cache = torch.randn(2, 5, block_size, kv_heads, head_dim)
    before = kv_cache.clone()
    slots = torch.tensor([13, 2, 7, 19])
    qkv = torch.randn(4, 3 * kv_heads * head_dim)
    _, k, v = (t.view(4, kv_heads, head_dim) for t in qkv.split(kv_heads * head_dim, dim=-1))
    store(kv_cache, slots, k, v)

    for slot, key, value in zip(slots.tolist(), k, v, strict=True):
        block, offset = divmod(slot, block_size)
        assert torch.equal(kv_cache[0, block, offset], key)
        assert torch.equal(kv_cache[1, block, offset], value)
    untouched = torch.ones(5 * block_size, dtype=torch.bool)
    untouched[slots] = False
    flat = kv_cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[:, untouched], before.view(2, -1, kv_heads, head_dim)[:, untouched])


@needs_native
def test_native_store_kv_rejects_slots_outside_the_cache() -> None:
    kv_cache = torch.zeros(2, 3, 4, 1, 8)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside"):
        ops._NATIVE.store_kv(kv_cache, torch.tensor([12]), k, k)
