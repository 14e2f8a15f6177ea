"""ContiguousKVManager: a whole max-length span per request, from admission to the end."""

from __future__ import annotations

import pytest

from tokenmill.kv.contiguous import ContiguousKVManager
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def test_admission_reserves_the_whole_span():
    kv = ContiguousKVManager(num_blocks=10, block_size=4, max_model_len=16)
    req = make_request("a", [1, 2])
    assert kv.allocate_slots(req, 2)
    assert kv.num_blocks_held("a") == 4


def test_the_pool_holds_as_many_requests_as_it_has_spans():
    kv = ContiguousKVManager(num_blocks=10, block_size=4, max_model_len=16)
    assert kv.allocate_slots(make_request("a", [1]), 1)
    assert kv.allocate_slots(make_request("b", [1]), 1)
    assert not kv.allocate_slots(make_request("c", [1]), 1)  # 2 free blocks, a span needs 4


def test_trimming_never_goes_below_the_reservation():
    kv = ContiguousKVManager(num_blocks=10, block_size=4, max_model_len=16)
    req = make_request("a", [1, 2])
    assert kv.allocate_slots(req, 2)
    kv.trim(req, 1)
    assert kv.num_blocks_held("a") == 4


def test_nothing_is_shared_or_cached():
    kv = ContiguousKVManager(num_blocks=10, block_size=4, max_model_len=16)
    first = make_request("a", list(range(9)))
    assert kv.allocate_slots(first, 9)
    kv.free(first)
    assert not kv.shares_blocks
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == []


def test_a_span_longer_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="max_model_len=64"):
        ContiguousKVManager(num_blocks=10, block_size=4, max_model_len=64)
