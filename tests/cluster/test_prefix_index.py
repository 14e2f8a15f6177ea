from tokenmill.cluster.pinning import replica_cores
from tokenmill.cluster.prefix_index import PrefixIndex, PrefixPolicy, prefix_keys

POLICY = PrefixPolicy(chunk_tokens=4, balance_abs=2, balance_rel=1.5, capacity=8)


def test_prefix_keys_chain_so_a_shared_start_shares_keys_and_nothing_after():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix_keys([1, 2, 3, 4, 0, 6, 7, 8], 4)
    assert len(a) == 2  # the partial last chunk has no key
    assert a[0] == b[0] and a[1] != b[1]


def test_request_goes_to_the_replica_holding_its_prefix_when_load_is_balanced():
    index = PrefixIndex(POLICY)
    keys = prefix_keys(list(range(16)), 4)
    index.record("b", keys)
    assert index.choose(keys, {"a": 0, "b": 1})[0] == "b"


def test_imbalanced_load_sends_the_request_to_the_least_loaded_replica():
    index = PrefixIndex(POLICY)
    keys = prefix_keys(list(range(16)), 4)
    index.record("b", keys)
    assert index.choose(keys, {"a": 0, "b": 5})[0] == "a"


def test_new_prefixes_spread_to_the_replica_holding_fewest():
    index = PrefixIndex(POLICY)
    index.record("a", prefix_keys(list(range(16)), 4))
    assert index.choose(prefix_keys(list(range(100, 116)), 4), {"a": 0, "b": 0})[0] == "b"


def test_a_replica_that_died_is_forgotten_and_capacity_evicts_oldest_keys():
    index = PrefixIndex(POLICY)
    old, new = prefix_keys(list(range(16)), 4), prefix_keys(list(range(50, 82)), 4)
    index.record("a", old)
    index.record("a", new)  # 4 + 8 keys > capacity 8: the old prompt's are evicted
    assert index.matched_chunks("a", old) == 0 and index.matched_chunks("a", new) == 8
    index.forget("a")
    assert index.matched_chunks("a", new) == 0


def test_replica_cores_are_disjoint_slices_or_none_when_cores_are_short():
    assert replica_cores(0, 2, [3, 2, 1, 0]) == [0, 1]
    assert replica_cores(1, 2, [0, 1, 2, 3]) == [2, 3]
    assert replica_cores(2, 2, [0, 1, 2, 3]) is None
