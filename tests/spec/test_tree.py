"""Draft trees: their shape, greedy walks, and sampled verification keeping the target's
distribution (chi-square on a toy p, as for the chain)."""

from __future__ import annotations

import pytest
import torch

from tests.spec.test_rejection import chi_square_p_value
from tokenmill.draft_tree import chain_parents, depths, first_path, is_chain, path_to
from tokenmill.spec.rejection import _draw
from tokenmill.spec.tree import accepted_drafts, verify_tree

# root -> a(0), b(1); a -> c(2), d(3); b -> e(4); c -> f(5)
PARENTS = (-1, -1, 0, 0, 1, 2)
TOKENS = (10, 11, 12, 13, 14, 15)


def test_depths_paths_and_first_path_follow_the_parents():
    assert depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    assert path_to(PARENTS, 5) == [0, 2, 5]
    assert path_to(PARENTS, -1) == []
    assert first_path(PARENTS) == [0, 2, 5]
    assert is_chain(chain_parents(4)) and not is_chain(PARENTS)


def test_a_parent_after_its_child_is_rejected():
    with pytest.raises(ValueError, match="parent"):
        depths((-1, 2, 0))


def test_greedy_walk_takes_the_longest_matching_path():
    # The target's argmax per row: root 11 (b), after b 14 (e), after e 99 (no child).
    argmax = {0: 11, 2: 14, 5: 99}
    emitted, accepted = verify_tree(PARENTS, TOKENS, argmax.__getitem__)
    assert emitted == [11, 14, 99]
    assert accepted == [1, 4]
    assert accepted_drafts(PARENTS, TOKENS, emitted) == accepted


def test_greedy_walk_emits_a_bonus_token_after_a_leaf():
    argmax = {0: 10, 1: 12, 3: 15, 6: 7}
    emitted, accepted = verify_tree(PARENTS, TOKENS, argmax.__getitem__)
    assert emitted == [10, 12, 15, 7]
    assert accepted == [0, 2, 5]


def test_sampled_tree_emits_each_token_from_the_target_distribution_of_its_row():
    """Toy target: a distribution per row over 5 tokens, drafts that cover several tokens per
    node. The first emitted token must follow row 0's p; the second, given the first was draft
    a, row 1's p (after a)."""
    vocab, trials = 5, 6000
    parents, tokens = (-1, -1, 0, 0), (0, 1, 2, 3)  # root -> 0, 1; after 0 -> 2, 3
    gen = torch.Generator().manual_seed(3)
    p = torch.rand(len(parents) + 1, vocab, generator=gen) ** 2
    p[0, 4] = 0.0  # never allowed at the root
    p[0, 0] = 1.0  # draft a is often right
    p = p / p.sum(-1, keepdim=True)
    draws = torch.Generator().manual_seed(0)
    first = torch.zeros(vocab, dtype=torch.long)
    second_after_a = torch.zeros(vocab, dtype=torch.long)
    for _ in range(trials):
        emitted, _ = verify_tree(parents, tokens, lambda row: _draw(p[row], draws))
        first[emitted[0]] += 1
        if emitted[0] == 0:
            second_after_a[emitted[1]] += 1
    assert second_after_a.sum() > 500, "the path through a child must be exercised"
    assert chi_square_p_value(first, p[0]) > 0.01
    assert chi_square_p_value(second_after_a, p[1]) > 0.01
