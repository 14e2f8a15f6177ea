"""KVCacheManager: block tables grow with tokens, prefixes are shared, contiguous reserves."""

from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.kv.kv_manager import KVCacheManager
from tokenmill.sampling.params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def test_blocks_are_allocated_as_tokens_arrive():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    assert kv.num_blocks_held("a") == 2
    req.num_computed_tokens = 6
    req.append_token(99)
    req.append_token(98)
    assert kv.allocate_slots(req, 1)
    assert kv.num_blocks_held("a") == 2  # 7 tokens still fit in two blocks of 4
    req.num_computed_tokens = 7
    assert kv.allocate_slots(req, 1)
    assert kv.num_blocks_held("a") == 2
    req.num_computed_tokens = 8
    req.append_token(97)
    assert kv.allocate_slots(req, 1)
    assert kv.num_blocks_held("a") == 3


def test_allocation_fails_without_side_effects_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_blocks_held("a") == 0
    assert kv.pool.num_free_blocks == 2


def test_second_request_reuses_the_full_blocks_of_a_shared_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    second = make_request("b", [*range(9), 500, 501])
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2  # tokens 0..7; token 8 is in a partial block of `first`
    second.num_computed_tokens = 8
    assert kv.allocate_slots(second, second.num_tokens - 8, hits)
    assert kv.num_blocks_held("b") == 3
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(kv.pool.blocks[i].ref_count == 2 for i in kv.block_ids("a")[:2])


def test_a_fully_cached_prompt_still_leaves_its_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    hits = kv.find_cached_prefix(make_request("b", list(range(8))))
    assert len(hits) == 1


def test_freed_prefix_stays_cached_until_its_space_is_needed():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    kv.free(first)
    assert kv.pool.num_free_blocks == 3
    again = make_request("b", [*range(8), 42])
    assert len(kv.find_cached_prefix(again)) == 2
    other = make_request("c", [7] * 12)
    assert kv.allocate_slots(other, 12)  # needs all three blocks: evicts the cached ones
    assert kv.find_cached_prefix(again) == []


def test_contiguous_mode_reserves_the_whole_span_at_admission():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False, reserve_tokens=16)
    req = make_request("a", [1, 2])
    assert kv.allocate_slots(req, 2)
    assert kv.num_blocks_held("a") == 4
