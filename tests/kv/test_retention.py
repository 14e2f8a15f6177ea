"""Prefix-cache lifetimes on a fake clock: the TTL drops unused cached blocks, retained blocks
outlive LRU pressure until their time yet yield to allocation, and bad settings are refused."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineArgs
from tokenmill.kv.block_pool import BlockPool, hash_block
from tokenmill.kv.paged import PagedKVManager
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cached_blocks(pool: BlockPool, count: int, first_token: int = 0) -> list:
    """`count` blocks cached under distinct hashes, then freed (least recent first)."""
    blocks = pool.allocate(count)
    for i, block in enumerate(blocks):
        pool.cache(block, hash_block(None, [first_token + i]), [first_token + i])
    pool.release(blocks)
    return blocks


def is_cached(pool: BlockPool, token: int) -> bool:
    return pool.lookup(hash_block(None, [token]), [token]) is not None


def test_ttl_drops_cached_blocks_unused_for_longer():
    clock = FakeClock()
    pool = BlockPool(4, cache_ttl_s=60, clock=clock)
    cached_blocks(pool, 1, first_token=0)
    clock.now += 30
    cached_blocks(pool, 1, first_token=1)
    clock.now += 40
    pool.expire()
    assert not is_cached(pool, 0) and is_cached(pool, 1)
    assert pool.num_free_blocks == 4


def test_ttl_never_drops_a_block_somebody_holds():
    clock = FakeClock()
    pool = BlockPool(2, cache_ttl_s=10, clock=clock)
    (block,) = pool.allocate(1)
    pool.cache(block, hash_block(None, [7]), [7])
    clock.now += 100
    pool.expire()
    assert block.block_hash is not None and block.ref_count == 1


def test_retained_block_survives_lru_pressure_until_its_ttl():
    clock = FakeClock()
    pool = BlockPool(4, max_retained_blocks=2, clock=clock)
    (kept,) = cached_blocks(pool, 1, first_token=0)
    pool.retain([kept], clock.now + 300)
    for round_ in range(3):  # churn the other three blocks
        cached_blocks(pool, 3, first_token=10 + 3 * round_)
    assert is_cached(pool, 0)
    clock.now += 301
    pool.expire()
    cached_blocks(pool, 3, first_token=50)
    cached_blocks(pool, 3, first_token=60)
    assert not is_cached(pool, 0)


def test_retained_blocks_yield_to_allocation_rather_than_refuse_it():
    clock = FakeClock()
    pool = BlockPool(4, max_retained_blocks=4, clock=clock)
    blocks = cached_blocks(pool, 4)
    pool.retain(blocks, clock.now + 300)
    assert pool.num_free_blocks == 4
    taken = pool.allocate(4)
    assert len(taken) == 4 and pool.num_retained_blocks == 0
    pool.release(taken)
    assert pool.num_free_blocks == 4


def test_retention_is_bounded_by_max_retained_blocks():
    pool = BlockPool(8, max_retained_blocks=2, clock=FakeClock())
    blocks = cached_blocks(pool, 4)
    pool.retain(blocks, 2000.0)
    assert pool.num_retained_blocks == 2
    assert sum(block.retained_until is not None for block in blocks) == 2


def test_a_request_with_cache_ttl_retains_its_prompt_blocks_when_it_ends():
    clock = FakeClock()
    kv = PagedKVManager(num_blocks=6, block_size=4, max_retained_fraction=0.5, clock=clock)
    request = Request("a", list(range(10)), SamplingParams(max_tokens=2, cache_ttl=120))
    assert kv.allocate_slots(request, 10)
    kv.free(request)
    assert kv.pool.num_retained_blocks == 2  # the two full prompt blocks, not the partial one
    other = Request("b", list(range(100, 116)), SamplingParams(max_tokens=2))
    assert kv.allocate_slots(other, 16)  # four blocks: only the unretained ones are taken
    kv.free(other)
    again = Request("c", list(range(10)), SamplingParams(max_tokens=2))
    assert len(kv.find_cached_prefix(again)) == 2
    clock.now += 121
    kv.expire()
    assert kv.pool.num_retained_blocks == 0
    assert kv.pool.num_free_blocks == 6


def test_retained_prompt_never_blocks_a_running_request():
    clock = FakeClock()
    kv = PagedKVManager(num_blocks=4, block_size=4, max_retained_fraction=1.0, clock=clock)
    retained = Request("a", list(range(16)), SamplingParams(max_tokens=2, cache_ttl=600))
    assert kv.allocate_slots(retained, 16)
    kv.free(retained)
    assert kv.pool.num_retained_blocks == 4
    running = Request("b", list(range(100, 116)), SamplingParams(max_tokens=2))
    assert kv.allocate_slots(running, 16)
    assert kv.num_blocks_held("b") == 4
    kv.free(running)
    assert kv.pool.num_free_blocks == 4


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prefix_cache_ttl", -5, "prefix_cache_ttl must be a number of seconds > 0"),
        ("prefix_cache_ttl", "60", "prefix_cache_ttl must be a number of seconds > 0"),
        ("max_retained_kv_fraction", 1.5, "max_retained_kv_fraction must be in"),
        ("kv_offload_bytes", "-1GiB", "kv_offload_bytes must be"),
    ],
)
def test_bad_lifetime_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{field: value})


@pytest.mark.parametrize("ttl", [-1, 0, float("inf")])
def test_bad_request_cache_ttl_is_refused(ttl):
    with pytest.raises(ValueError, match="cache_ttl must be"):
        SamplingParams(cache_ttl=ttl)
