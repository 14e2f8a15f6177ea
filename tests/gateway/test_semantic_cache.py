"""The cache's own rules, on a real embedder: tiers, scopes, TTL, capacity, the particulars
guard and its settings' checks."""

from __future__ import annotations

import pytest

from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.gateway import embedding
from tokenmill.gateway.embedding import packaged_embedder
from tokenmill.gateway.semantic_cache import (
    CachedAnswer,
    CacheSettings,
    SemanticCache,
    same_particulars,
)
from tokenmill.request import RequestMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def answer(text: str) -> CachedAnswer:
    completion = CompletionOutput(0, text, [1], None, None, "stop")
    output = RequestOutput("r", "p", [1], [completion], True, 0, RequestMetrics(0.0))
    return CachedAnswer(output, "m")


def make_cache(clock: Clock | None = None, **settings) -> SemanticCache:
    return SemanticCache(CacheSettings(**settings), packaged_embedder(), clock or Clock())


def test_the_exact_tier_folds_case_and_spacing():
    cache = make_cache()
    cache.insert("s", "What is the capital of France?", answer("Paris"))
    tier, found = cache.lookup("s", "what is the  capital of france?")
    assert (tier, found.output.outputs[0].text) == ("exact", "Paris")


def test_a_paraphrase_hits_the_semantic_tier():
    cache = make_cache()
    cache.insert("s", "How do I boil an egg?", answer("Boil it."))
    assert cache.lookup("s", "How should I boil an egg?")[0] == "semantic"


def test_a_hit_never_crosses_scopes():
    cache = make_cache()
    cache.insert("model-a", "How do I boil an egg?", answer("Boil it."))
    assert cache.lookup("model-b", "How do I boil an egg?") is None


def test_an_entry_expires_after_its_ttl():
    clock = Clock()
    cache = make_cache(clock, ttl_s=10)
    cache.insert("s", "Name a fruit.", answer("Apple"))
    clock.now = 9.9
    assert cache.lookup("s", "Name a fruit.") is not None
    clock.now = 10.0
    assert cache.lookup("s", "Name a fruit.") is None
    assert len(cache) == 0


def test_beyond_capacity_the_least_recently_used_goes_first():
    cache = make_cache(capacity=2)
    cache.insert("s", "Who wrote Hamlet?", answer("Shakespeare"))
    cache.insert("s", "How far away is the Moon?", answer("384,400 km"))
    cache.lookup("s", "Who wrote Hamlet?")  # now the Moon is the least recently used
    cache.insert("s", "Which gas do plants take in?", answer("CO2"))
    assert cache.lookup("s", "How far away is the Moon?") is None
    assert cache.lookup("s", "Who wrote Hamlet?") is not None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("what is 12+7?", "what is 12+8?"),
        ("is the sky blue?", "is the sky not blue?"),
        ("did alice pay bob?", "did bob pay alice?"),
    ],
)
def test_near_misses_do_not_name_the_same_particulars(a, b):
    assert not same_particulars(a, b)


def test_a_paraphrase_with_the_same_numbers_names_the_same_particulars():
    assert same_particulars("what is 3 times 4?", "what's 3 multiplied by 4?")


def test_the_guard_also_refuses_a_paraphrase_that_only_reorders_words():
    """The price of catching swapped entities: the same words in another order never hit."""
    assert not same_particulars("how many legs has a spider?", "a spider has how many legs?")


def test_without_the_guard_a_swapped_entity_is_a_false_hit():
    cache = make_cache(guard=False)
    cache.insert("s", "Did Alice pay Bob?", answer("Yes"))
    assert cache.lookup("s", "Did Bob pay Alice?")[0] == "semantic"
    guarded = make_cache()
    guarded.insert("s", "Did Alice pay Bob?", answer("Yes"))
    assert guarded.lookup("s", "Did Bob pay Alice?") is None


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_a_threshold_outside_0_1_is_refused(threshold):
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\]"):
        CacheSettings(threshold=threshold)


def test_a_missing_embedding_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(embedding.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps wordllama=="):
        packaged_embedder.__wrapped__()
