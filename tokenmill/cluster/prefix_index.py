"""Which replica probably holds a prompt's prefix in its KV cache: SGLang's cache-aware policy
over an approximate index of what each replica was sent.

Prompts are cut into chunks of `chunk_tokens` token ids; a chunk's key chains its parent's, so
one key names a whole prefix. Each replica remembers the keys of the prompts routed to it (most
recent last, up to `capacity` keys). A request goes to the replica with the longest cached
prefix, unless load is imbalanced (the busiest replica holds more than `balance_abs` requests
more than the idlest and more than `balance_rel` times as many): then to the least loaded.
No match at all also goes to the least loaded, fewest keys first, which spreads new prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

CHUNK_TOKENS = 64
"""Routing granularity: finer than this gains little once a prompt shares whole chunks."""


@dataclass(frozen=True)
class PrefixPolicy:
    chunk_tokens: int = CHUNK_TOKENS
    balance_abs: int = 8
    balance_rel: float = 1.5
    capacity: int = 200_000  # keys per replica, about 13M prompt tokens at 64 a chunk


def prefix_keys(token_ids: Sequence[int], chunk_tokens: int) -> list[int]:
    """The chained key of each whole chunk of the prompt."""
    keys, parent = [], 0
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        parent = hash((parent, tuple(token_ids[start : start + chunk_tokens])))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Prefix keys per replica, and the choice of replica for a prompt."""

    def __init__(self, policy: PrefixPolicy = PrefixPolicy()) -> None:
        self.policy = policy
        self._keys: dict[Hashable, OrderedDict[int, None]] = {}

    def matched_chunks(self, replica: Hashable, keys: Sequence[int]) -> int:
        held = self._keys.get(replica)
        if not held:
            return 0
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def choose(self, keys: Sequence[int], loads: Mapping[Hashable, int]) -> list[Hashable]:
        """Replicas best first: the best prefix match when load is balanced, else by load."""
        by_load = sorted(loads, key=lambda r: (loads[r], len(self._keys.get(r, ()))))
        if not by_load or self.imbalanced(loads.values()):
            return by_load
        matches = {r: self.matched_chunks(r, keys) for r in loads}
        best = max(matches.values())
        if best == 0:
            return by_load
        return sorted(by_load, key=lambda r: -matches[r])

    def imbalanced(self, loads: Sequence[int] | object) -> bool:
        values = list(loads)  # type: ignore[call-overload]
        high, low = max(values, default=0), min(values, default=0)
        p = self.policy
        return high - low > p.balance_abs and high > p.balance_rel * low

    def record(self, replica: Hashable, keys: Sequence[int]) -> None:
        """`replica` was sent a prompt with these keys: it will hold them once it prefilled."""
        held = self._keys.setdefault(replica, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.policy.capacity:
            held.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica that died or left lost its cache."""
        self._keys.pop(replica, None)
