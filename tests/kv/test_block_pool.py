"""BlockPool: reference counts, LRU eviction of cached blocks, collision safety."""

from __future__ import annotations

import pytest

from tokenmill.kv.block_pool import BlockPool, hash_block


def test_allocate_and_release_return_every_block():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert pool.num_free_blocks == 3
    pool.release(reversed(blocks))
    assert pool.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_over_allocation_is_refused():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="3 blocks with 2 free"):
        pool.allocate(3)


def test_release_below_zero_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])


def test_freed_cached_block_can_be_reacquired_with_its_contents():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache(block, h, [1, 2, 3, 4])
    pool.release([block])
    hit = pool.lookup(h, [1, 2, 3, 4])
    assert hit is block
    pool.acquire([hit])
    assert hit.ref_count == 1 and pool.num_free_blocks == 3


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, b"first-hash-00000", [1])
    pool.cache(second, b"second-hash-0000", [2])
    pool.release([first])
    pool.release([second])
    (reused,) = pool.allocate(1)
    assert reused is first
    assert pool.lookup(b"first-hash-00000", [1]) is None
    assert pool.lookup(b"second-hash-0000", [2]) is second


def test_lookup_compares_token_ids_so_a_colliding_hash_misses():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, b"same-hash-000000", [1, 2])
    assert pool.lookup(b"same-hash-000000", [9, 9]) is None


def test_chained_hash_depends_on_the_parent():
    tokens = [5, 6, 7, 8]
    assert hash_block(hash_block(None, [1]), tokens) != hash_block(hash_block(None, [2]), tokens)


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1])
    pool.cache(block, h, [1])
    assert pool.lookup(h, [1]) is None
