"""Verifying a draft tree (its shape: tokenmill/draft_tree.py).

Verification walks down from the root: at each node the target picks its token (argmax, or one
draw from its distribution), and the walk moves to the child drafting that token or stops,
emitting it. With one-hot drafts this is the rule of SpecInfer (Miao et al., 2024) and EAGLE-2:
trying the children one after another, each accepted with its residual probability and removed
from the residual when rejected, accepts child x with probability p(x) and otherwise emits a
draw from p without the children, which is one draw from p. So the emitted tokens follow the
target's distribution exactly, and a seeded request emits the tokens plain decoding would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def verify_tree(
    parents: Sequence[int], draft_token_ids: Sequence[int], pick: Callable[[int], int]
) -> tuple[list[int], list[int]]:
    """Walk down from the root: `pick(row)` is the target's token at a row (0 the root, 1 + i
    after draft i). Returns the emitted tokens (the accepted drafts, then the target's own
    token) and the accepted drafts' indices."""
    children: dict[int, dict[int, int]] = {}
    for i, (parent, token) in enumerate(zip(parents, draft_token_ids, strict=True)):
        children.setdefault(parent, {}).setdefault(token, i)
    node, accepted = -1, []
    while True:
        token = pick(1 + node)
        child = children.get(node, {}).get(token)
        if child is None:
            return [draft_token_ids[i] for i in accepted] + [token], accepted
        accepted.append(child)
        node = child


def accepted_drafts(
    parents: Sequence[int], draft_token_ids: Sequence[int], emitted: Sequence[int]
) -> list[int]:
    """The drafts a verification accepted, from the tokens it emitted (all but the last are
    accepted drafts, each a child of the one before)."""
    accepted, node = [], -1
    for token in emitted[:-1]:
        node = next(
            i
            for i, (parent, draft) in enumerate(zip(parents, draft_token_ids, strict=True))
            if parent == node and draft == token
        )
        accepted.append(node)
    return accepted
