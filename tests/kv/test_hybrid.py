"""HybridKVManager without a model: a full-attention group and a sliding-window group over one
pool; the sliding group holds only its window's blocks, prefix hits need only those, and every
block comes back when requests end."""

from __future__ import annotations

import random

from tokenmill.kv.groups import KVGroup, KVGroups
from tokenmill.kv.hybrid import HybridKVManager
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams

BLOCK = 4
WINDOW = 8
GROUPS = KVGroups((KVGroup((1,), None), KVGroup((0,), WINDOW)), 2)  # full group first


def make_kv(num_blocks: int = 64, enable_prefix_caching: bool = True) -> HybridKVManager:
    return HybridKVManager(GROUPS, num_blocks, BLOCK, enable_prefix_caching)


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=64))


def held_per_group(kv: HybridKVManager, request_id: str) -> list[int]:
    return [group.num_blocks_held(request_id) for group in kv.groups]


def compute(kv: HybridKVManager, request: Request, num_new: int) -> None:
    assert kv.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new


def decode(kv: HybridKVManager, request: Request, num_tokens: int) -> None:
    for i in range(num_tokens):
        request.append_token(7000 + i)
        compute(kv, request, 1)


def test_the_sliding_group_gives_back_blocks_outside_its_window_as_tokens_arrive():
    kv = make_kv()
    request = make_request("a", list(range(40)))
    compute(kv, request, 40)
    assert held_per_group(kv, "a") == [10, 10]  # the prompt's own query read all of it
    decode(kv, request, 1)
    # The next query (position 40) reads positions 33..40: blocks 8..10.
    assert held_per_group(kv, "a") == [11, 3]
    assert kv.group_block_ids("a")[1][:8] == [kv.null_block.block_id] * 8
    decode(kv, request, 12)
    assert held_per_group(kv, "a")[1] <= -(-(WINDOW - 1) // BLOCK) + 1


def test_a_chunked_prompt_keeps_what_its_next_chunk_reads():
    kv = make_kv()
    request = make_request("a", list(range(40)))
    compute(kv, request, 16)
    assert kv.allocate_slots(request, 16)  # the chunk at 16 reads from position 9: block 2 on
    assert kv.group_block_ids("a")[1][:2] == [kv.null_block.block_id] * 2
    assert held_per_group(kv, "a") == [8, 6]


def test_every_block_is_free_again_after_requests_end():
    rng = random.Random(0)
    kv = make_kv(num_blocks=48)
    live: list[Request] = []
    for step in range(300):
        if len(live) < 3:
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            request = make_request(f"r{step}", prompt)
            cached = kv.find_cached_prefix(request)
            request.num_computed_tokens = len(cached) * BLOCK
            if kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens, cached):
                request.num_computed_tokens = request.num_tokens
                live.append(request)
            continue
        request = rng.choice(live)
        request.append_token(rng.randrange(50))
        if rng.random() < 0.1 or not kv.allocate_slots(request, 1):
            kv.free(request)
            live.remove(request)
        else:
            request.num_computed_tokens += 1
    for request in live:
        kv.free(request)
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_count == 0 for block in kv.pool.blocks[1:])


def test_a_failed_allocation_takes_nothing_from_any_group():
    kv = make_kv(num_blocks=9)  # 8 usable
    request = make_request("a", list(range(20)))
    assert not kv.allocate_slots(request, 20)  # 5 blocks in each group
    assert kv.num_free_blocks == 8
    assert held_per_group(kv, "a") == [0, 0]


def test_a_prefix_hit_needs_only_the_sliding_groups_window_blocks():
    kv = make_kv(num_blocks=24)
    first = make_request("a", list(range(24)))
    compute(kv, first, 24)
    decode(kv, first, 1)  # the sliding group gives back blocks 0..3, still cached
    kv.free(first)
    # Take every uncached free block and the four given back first, evicting those four.
    uncached = sum(block.block_hash is None for block in kv.pool.blocks[1:])
    kv.pool.release(kv.pool.allocate(uncached + 4))
    second = make_request("b", [*range(24), 99])
    hit = kv.find_cached_prefix(second)
    assert len(hit) == 6  # all of the 24 tokens, though the sliding group lost blocks 0..3
    full, sliding = hit.per_group
    assert len(full) == 6 and kv.null_block not in full
    assert sliding[:4] == [kv.null_block] * 4 and kv.null_block not in sliding[4:]
    second.num_computed_tokens = 24
    assert kv.allocate_slots(second, 1, hit)
    assert held_per_group(kv, "b") == [7, 3]  # 24 tokens in 6 blocks, plus the new one


def test_a_prefix_hit_needs_the_sliding_groups_window_blocks_too():
    kv = make_kv(num_blocks=40)
    first = make_request("a", list(range(24)))
    compute(kv, first, 24)
    decode(kv, first, 8)  # the sliding group gives back blocks 0..5 in turn, still cached
    # Evict exactly those six: every uncached free block goes first, then them.
    uncached = sum(block.block_hash is None and block.ref_count == 0 for block in kv.pool.blocks)
    kv.pool.release(kv.pool.allocate(uncached + 6))
    second = make_request("b", [*range(24), 99])
    assert len(kv.groups[0].find_cached_prefix(second)) == 6  # the full group has them all
    assert len(kv.find_cached_prefix(second)) == 0  # no length has its window cached


def test_a_sibling_does_not_fork_a_prompt_whose_window_the_parent_gave_back():
    kv = make_kv()
    parent = make_request("p", list(range(20)))
    compute(kv, parent, 20)
    assert len(kv.shared_prompt(parent, 19)) == 5
    decode(kv, parent, 12)  # the next query is at 31: blocks before 24 are given back
    assert len(kv.shared_prompt(parent, 19)) == 0


def test_the_longest_request_counts_every_groups_blocks_at_its_largest_step():
    # 20 usable blocks; decoding a token at a time a long sequence holds n full-group blocks
    # and 3 sliding ones, computing a whole prompt at once the sliding group holds all n.
    by_token = HybridKVManager(GROUPS, 21, BLOCK, True, max_chunk_tokens=1)
    assert by_token.max_tokens_per_request == 17 * BLOCK
    whole_prompt = HybridKVManager(GROUPS, 21, BLOCK, True, max_chunk_tokens=None)
    assert whole_prompt.max_tokens_per_request == 10 * BLOCK
