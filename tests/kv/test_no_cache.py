"""NoKVCache: the baseline keeps nothing, so every request always fits and holds no blocks."""

from __future__ import annotations

from tokenmill.kv.no_cache import NoKVCache
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams


def test_any_request_fits_and_holds_nothing():
    kv = NoKVCache(block_size=16)
    req = Request("a", list(range(5000)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(req, 5000)
    assert kv.block_ids("a") == [] and kv.num_blocks_held("a") == 0
    assert kv.find_cached_prefix(req) == []
    assert not kv.holds_kv and kv.max_tokens_per_request is None
    assert kv.num_blocks == kv.num_free_blocks == 0
