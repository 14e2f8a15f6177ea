"""The shape of a draft tree: several candidate continuations verified in one target pass.

A tree of n drafts is its `parents`: `parents[i]` is the index of draft i's parent, or -1 when
draft i follows the request's last token (the root). Parents come before their children
(breadth first), so every prefix of a tree is a tree: cutting one to a token budget keeps it
valid. A chain of k drafts, the shape every proposer but a tree drafter makes, is
`(-1, 0, ..., k - 2)`; an empty `parents` also means a chain.

In the target's pass the root and the drafts are one chunk: row 0 is the root, row 1 + i is
draft i, at position root + depth(i), attending to the context, the root and its own ancestors.
Plain data, read by the scheduler, the runner, attention and the verifier
(tokenmill/spec/tree.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_parents(num_drafts: int) -> tuple[int, ...]:
    return tuple(range(-1, num_drafts - 1))


def tree_parents(parents: Sequence[int], num_drafts: int) -> Sequence[int]:
    """The parents of `num_drafts` drafts: `parents` when given, else a chain's."""
    return parents if parents else chain_parents(num_drafts)


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Each draft's distance from the root (1 for the root's children)."""
    result: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft {i}'s parent {parent} must come before it")
        result.append(1 if parent < 0 else result[parent] + 1)
    return result


def path_flags(parents: Sequence[int]) -> list[tuple[bool, ...]]:
    """For each draft i, i + 1 flags over drafts 0..i: which of them lie on its path from the
    root (its ancestors and itself), the keys its row of the verify pass sees among them."""
    rows: list[tuple[bool, ...]] = []
    for i, parent in enumerate(parents):
        above = rows[parent] + (False,) * (i - parent - 1) if parent >= 0 else (False,) * i
        rows.append((*above, True))
    return rows


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The drafts from a child of the root down to `node` (none for the root, -1)."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def first_path(parents: Sequence[int]) -> list[int]:
    """The drafts of the path through each node's first child: a tree drafter's best guess,
    as a chain."""
    path, node = [], -1
    while True:
        child = next((i for i, parent in enumerate(parents) if parent == node), None)
        if child is None:
            return path
        path.append(child)
        node = child
