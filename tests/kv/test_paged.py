"""PagedKVManager: block tables grow with tokens, prefixes are shared, shared blocks are copied
before a write."""

from __future__ import annotations

from tokenmill.kv.paged import PagedKVManager
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def test_blocks_are_allocated_as_tokens_arrive():
    kv = PagedKVManager(num_blocks=10, block_size=4)
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
    kv = PagedKVManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_blocks_held("a") == 0
    assert kv.pool.num_free_blocks == 2


def test_second_request_reuses_the_full_blocks_of_a_shared_prefix():
    kv = PagedKVManager(num_blocks=10, block_size=4)
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
    kv = PagedKVManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    hits = kv.find_cached_prefix(make_request("b", list(range(8))))
    assert len(hits) == 1


def test_freed_prefix_stays_cached_until_its_space_is_needed():
    kv = PagedKVManager(num_blocks=3, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    kv.free(first)
    assert kv.pool.num_free_blocks == 3
    again = make_request("b", [*range(8), 42])
    assert len(kv.find_cached_prefix(again)) == 2
    other = make_request("c", [7] * 12)
    assert kv.allocate_slots(other, 12)  # needs all three blocks: evicts the cached ones
    assert kv.find_cached_prefix(again) == []


def fork(kv: PagedKVManager, parent: Request, request_id: str) -> Request:
    """A sibling of `parent` that takes over all of its prompt but the last token."""
    sibling = make_request(request_id, parent.prompt_token_ids)
    sibling.num_computed_tokens = sibling.num_prompt_tokens - 1
    shared = kv.shared_prompt(parent, sibling.num_computed_tokens)
    assert kv.allocate_slots(sibling, 1, shared)
    return sibling


def test_a_write_into_a_shared_partial_block_copies_it_first():
    kv = PagedKVManager(num_blocks=10, block_size=4)
    parent = make_request("p", list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    assert kv.take_block_copies() == []  # a block held alone is written in place
    sibling = fork(kv, parent, "s")
    held, own = kv.block_ids("p"), kv.block_ids("s")
    assert own[:2] == held[:2] and own[2] not in held
    assert kv.take_block_copies() == [(held[2], own[2])]
    assert kv.take_block_copies() == []
    refs = [kv.pool.blocks[i].ref_count for i in [*held, own[2]]]
    assert refs == [2, 2, 1, 1]
    kv.free(parent)
    kv.free(sibling)
    assert kv.pool.num_free_blocks == 10


def test_the_last_sharer_of_a_block_writes_it_in_place():
    kv = PagedKVManager(num_blocks=10, block_size=4)
    parent = make_request("p", list(range(6)))
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 5  # a chunk ended before the last prompt token
    sibling = fork(kv, parent, "s")
    (copy,) = kv.take_block_copies()
    assert kv.allocate_slots(parent, 1)  # the parent now holds its partial block alone
    assert kv.take_block_copies() == []
    assert kv.block_ids("p")[1] == copy[0] and kv.block_ids("s")[1] == copy[1]
    assert sibling.num_computed_tokens == 5


def test_a_prompt_ending_one_past_a_block_boundary_shares_only_full_blocks():
    kv = PagedKVManager(num_blocks=10, block_size=4)
    parent = make_request("p", list(range(9)))  # the last token starts a new block
    assert kv.allocate_slots(parent, 9)
    parent.num_computed_tokens = 9
    fork(kv, parent, "s")
    assert kv.take_block_copies() == []
    assert kv.block_ids("s")[:2] == kv.block_ids("p")[:2]
    assert kv.block_ids("s")[2] != kv.block_ids("p")[2]


def test_copy_on_write_without_a_free_block_fails_and_changes_nothing():
    kv = PagedKVManager(num_blocks=3, block_size=4)
    parent = make_request("p", list(range(10)))
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    sibling = make_request("s", list(range(10)))
    sibling.num_computed_tokens = 9
    assert not kv.allocate_slots(sibling, 1, kv.shared_prompt(parent, 9))
    assert kv.num_blocks_held("s") == 0
    assert [block.ref_count for block in kv.pool.blocks] == [1, 1, 1]
    assert kv.take_block_copies() == []


def test_a_copy_into_a_block_freed_in_the_same_step_is_dropped():
    """A request preempted in the step that copied a block for it gives the copy back; the
    block may then go to somebody else before the runner would have copied into it."""
    kv = PagedKVManager(num_blocks=10, block_size=4)
    parent = make_request("p", list(range(10)))
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    sibling = fork(kv, parent, "s")
    kv.free(sibling)
    assert kv.take_block_copies() == []
    assert [kv.pool.blocks[i].ref_count for i in kv.block_ids("p")] == [1, 1, 1]
