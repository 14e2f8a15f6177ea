"""The semantic cache's SQLite store: what a restarted cache reads back, and what it drops."""

from __future__ import annotations

import pytest

from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.gateway.cache_store import CacheStore
from tokenmill.gateway.embedding import packaged_embedder
from tokenmill.gateway.semantic_cache import CachedAnswer, CacheSettings, SemanticCache
from tokenmill.gateway.transcript import steps_array
from tokenmill.request import RequestMetrics
from tokenmill.sampling.sampler import TokenLogprobs


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def answer(text: str, model: str = "m") -> CachedAnswer:
    logprobs = [TokenLogprobs(7, -0.5, 1, [(7, -0.5), (9, -1.5)])]
    completion = CompletionOutput(0, text, [7], -0.5, logprobs, "stop")
    output = RequestOutput("r", "p", [1, 2], [completion], True, 1, RequestMetrics(3.0))
    return CachedAnswer(output, model, steps_array([1, len(text), 1]))


def restarted(path, wall: Clock, **settings) -> SemanticCache:
    """A cache over the store at `path`, as a new process would build it."""
    return SemanticCache(
        CacheSettings(**settings), packaged_embedder(), Clock(), CacheStore(path, wall)
    )


def test_an_entry_survives_a_restart_whole(tmp_path):
    wall = Clock(1000.0)
    restarted(tmp_path / "c.db", wall).insert("s", "Name a fruit.", answer("Apple", "gemma"))
    tier, found = restarted(tmp_path / "c.db", wall).lookup("s", "name a fruit.")
    assert tier == "exact"
    assert found == answer("Apple", "gemma")


def test_a_restored_entry_is_found_by_similarity_in_its_scope_only(tmp_path):
    wall = Clock(1000.0)
    restarted(tmp_path / "c.db", wall).insert("s", "How do I boil an egg?", answer("Boil it."))
    cache = restarted(tmp_path / "c.db", wall)
    assert cache.lookup("s", "How should I boil an egg?")[0] == "semantic"
    assert cache.lookup("other", "How do I boil an egg?") is None


def test_an_entry_expired_while_the_server_was_down_is_not_restored(tmp_path):
    wall = Clock(1000.0)
    restarted(tmp_path / "c.db", wall, ttl_s=60).insert("s", "Name a fruit.", answer("Apple"))
    wall.now += 61
    cache = restarted(tmp_path / "c.db", wall, ttl_s=60)
    assert len(cache) == 0
    assert cache.lookup("s", "Name a fruit.") is None


def test_a_restored_entry_keeps_only_the_time_it_had_left(tmp_path):
    wall = Clock(1000.0)
    restarted(tmp_path / "c.db", wall, ttl_s=60).insert("s", "Name a fruit.", answer("Apple"))
    wall.now += 50
    cache = restarted(tmp_path / "c.db", wall, ttl_s=60)
    assert cache.lookup("s", "Name a fruit.") is not None
    cache.clock.now += 11  # the cache's own clock: past the 10 s the entry had left
    assert cache.lookup("s", "Name a fruit.") is None


def test_the_least_recently_used_go_first_when_a_restart_lowers_the_capacity(tmp_path):
    wall = Clock(1000.0)
    first = restarted(tmp_path / "c.db", wall)
    for name in ("a fruit", "a tree", "a river"):
        wall.now += 1
        first.insert("s", f"Name {name}.", answer(name))
    wall.now += 1
    first.lookup("s", "Name a fruit.")  # now the most recently used
    cache = restarted(tmp_path / "c.db", wall, capacity=2)
    assert cache.lookup("s", "Name a tree.") is None
    assert cache.lookup("s", "Name a fruit.") is not None
    assert cache.lookup("s", "Name a river.") is not None


def test_a_file_that_is_not_a_cache_is_a_clear_error(tmp_path):
    path = tmp_path / "c.db"
    path.write_text("not a database, just some text that SQLite cannot read" * 20)
    with pytest.raises(ValueError, match="semantic-cache-path"):
        CacheStore(path)
