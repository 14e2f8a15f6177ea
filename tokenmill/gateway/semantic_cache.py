"""The semantic response cache: finished answers kept by what was asked, served again to a
request that asks the same thing.

Two tiers. Exact: the normalised query (case and spacing folded) within its scope. Semantic:
the cached query of the same scope whose embedding is most similar, if at least `threshold`
and if both name the same particulars (numbers, negations, the order of the same words), since
an averaged embedding barely moves between "12+7" and "12+8" or "Alice paid Bob" and "Bob paid
Alice". A scope is everything else that shapes an answer (model, sampling settings, system
prompt, earlier turns): a hit never crosses scopes. Entries expire after `ttl_s` and the least
recently used goes first beyond `capacity`. With a store (gateway/cache_store.py) every change is
written through, and the entries still live are read back at start.
"""

from __future__ import annotations

import hashlib
import re
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.engine.outputs import RequestOutput
from tokenmill.gateway.embedding import TextEmbedder
from tokenmill.gateway.transcript import steps_array

if TYPE_CHECKING:
    from tokenmill.gateway.cache_store import CacheStore

DEFAULT_THRESHOLD = 0.94
"""The lowest threshold with no false hit on the repository's near-miss pairs, guard on
(`tokenmill cache evaluate`, docs/routing-and-caching.md)."""

EXACT, SEMANTIC = "exact", "semantic"
NEGATIONS = frozenset(
    [
        "not",
        "no",
        "never",
        "none",
        "nobody",
        "nothing",
        "neither",
        "nor",
        "without",
        "cannot",
        "can't",
        "don't",
        "doesn't",
        "isn't",
        "aren't",
        "wasn't",
        "weren't",
        "won't",
        "shouldn't",
        "wouldn't",
        "couldn't",
        "didn't",
        "hasn't",
        "haven't",
    ]
)
_WORD = re.compile(r"[\w']+|[^\w\s]")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


@dataclass(frozen=True)
class CacheSettings:
    threshold: float = DEFAULT_THRESHOLD
    ttl_s: float = 3600.0
    capacity: int = 10_000
    guard: bool = True  # require the same particulars for a semantic hit

    def __post_init__(self) -> None:
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"semantic cache threshold must be in [0, 1], got {self.threshold}")
        if not self.ttl_s > 0:
            raise ValueError(f"semantic cache TTL must be > 0 seconds, got {self.ttl_s}")
        if self.capacity < 1:
            raise ValueError(f"semantic cache capacity must be >= 1, got {self.capacity}")


@dataclass
class CachedAnswer:
    output: RequestOutput
    model: str  # the model that answered (a route's pick)
    steps: array = field(default_factory=steps_array)  # how it grew (gateway/transcript.py)


@dataclass
class _Entry:
    scope: str
    query: str
    vector: np.ndarray
    answer: CachedAnswer
    expires: float


def normalise(text: str) -> str:
    return " ".join(text.casefold().split())


def same_particulars(a: str, b: str) -> bool:
    """Whether two normalised queries name the same numbers and negations, and are not the same
    words in another order (swapped entities)."""
    if _NUMBER.findall(a) != _NUMBER.findall(b):
        return False
    words_a, words_b = _WORD.findall(a), _WORD.findall(b)
    if {w for w in words_a if w in NEGATIONS} != {w for w in words_b if w in NEGATIONS}:
        return False
    return not (words_a != words_b and sorted(words_a) == sorted(words_b))


class SemanticCache:
    def __init__(
        self,
        settings: CacheSettings,
        embedder: TextEmbedder,
        clock: Callable[[], float] = time.monotonic,
        store: CacheStore | None = None,
    ) -> None:
        self.settings = settings
        self.embedder = embedder
        self.clock = clock
        self.store = store
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._expiry: dict[str, float] = {}  # soonest first: restored entries, then one TTL
        self._scopes: dict[str, _ScopeIndex] = {}
        if store is not None:
            self._restore(store)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, scope: str, query: str) -> tuple[str, CachedAnswer] | None:
        """(tier, answer) of a live entry answering `query` in `scope`, or None."""
        self._drop_expired()
        query = normalise(query)
        key = _key(scope, query)
        if key in self._entries:
            self._used(key)
            return EXACT, self._entries[key].answer
        index = self._scopes.get(scope)
        if index is None:
            return None
        similarity = index.similarity(self.embedder.embed([query])[0])
        candidates = np.flatnonzero(similarity >= self.settings.threshold)
        for row in candidates[np.argsort(-similarity[candidates])]:
            key = index.keys[row]
            entry = self._entries[key]
            if not self.settings.guard or same_particulars(query, entry.query):
                self._used(key)
                return SEMANTIC, entry.answer
        return None

    def insert(self, scope: str, query: str, answer: CachedAnswer) -> None:
        query = normalise(query)
        key = _key(scope, query)
        self._remove(key)
        vector = self.embedder.embed([query])[0]
        self._add(key, scope, query, vector, answer, self.settings.ttl_s)
        if self.store is not None:
            self.store.put(key, scope, query, vector, answer, self.settings.ttl_s)
        self._evict_beyond_capacity()

    def _add(
        self,
        key: str,
        scope: str,
        query: str,
        vector: np.ndarray,
        answer: CachedAnswer,
        ttl_s: float,
    ) -> None:
        expires = self.clock() + ttl_s
        self._entries[key] = _Entry(scope, query, vector, answer, expires)
        self._expiry[key] = expires
        self._scopes.setdefault(scope, _ScopeIndex(self.embedder.dim)).add(key, vector)

    def _restore(self, store: CacheStore) -> None:
        """The store's live entries, each with the time it has left (at most this TTL)."""
        now = store.wall_clock()
        for entry in store.load():
            vector = entry.vector
            if vector.shape != (self.embedder.dim,):  # stored by another embedder
                vector = self.embedder.embed([entry.query])[0]
            ttl_s = min(entry.expires_at - now, self.settings.ttl_s)
            self._add(entry.key, entry.scope, entry.query, vector, entry.answer, ttl_s)
        self._expiry = dict(sorted(self._expiry.items(), key=lambda item: item[1]))
        self._evict_beyond_capacity()

    def _used(self, key: str) -> None:
        self._entries.move_to_end(key)
        if self.store is not None:
            self.store.touch(key)

    def _evict_beyond_capacity(self) -> None:
        while len(self._entries) > self.settings.capacity:
            self._remove(next(iter(self._entries)))

    def _drop_expired(self) -> None:
        now = self.clock()
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._remove(next(iter(self._expiry)))

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            del self._expiry[key]
            index = self._scopes[entry.scope]
            index.remove(key)
            if not index.keys:
                del self._scopes[entry.scope]
            if self.store is not None:
                self.store.delete(key)


class _ScopeIndex:
    """The vectors of one scope's entries as rows of one matrix (grown by doubling; a removed
    row is filled by the last), so a lookup is one matrix-vector product."""

    def __init__(self, dim: int) -> None:
        self.keys: list[str] = []
        self._rows: dict[str, int] = {}
        self._matrix = np.zeros((8, dim), dtype=np.float32)

    def add(self, key: str, vector: np.ndarray) -> None:
        if len(self.keys) == len(self._matrix):
            self._matrix = np.concatenate([self._matrix, np.zeros_like(self._matrix)])
        self._rows[key] = len(self.keys)
        self._matrix[len(self.keys)] = vector
        self.keys.append(key)

    def remove(self, key: str) -> None:
        row, last = self._rows.pop(key), len(self.keys) - 1
        if row != last:
            moved = self.keys[last]
            self.keys[row], self._rows[moved] = moved, row
            self._matrix[row] = self._matrix[last]
        self.keys.pop()

    def similarity(self, vector: np.ndarray) -> np.ndarray:
        return self._matrix[: len(self.keys)] @ vector


def _key(scope: str, query: str) -> str:
    return hashlib.sha256(f"{scope}\x00{query}".encode()).hexdigest()
