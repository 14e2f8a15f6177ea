"""EAGLE-2's dynamic tree: the shape follows the drafter's confidence (a toy drafter whose next
token probabilities depend on the token fed). Engine-level exactness with the shipped head
drafting trees is tests/spec/test_tree_drafters.py's."""

from __future__ import annotations

import math

import torch

from tokenmill.draft_tree import depths, path_to
from tokenmill.spec.eagle_tree import TreeDraft, draft_trees

VOCAB = torch.tensor([10, 11, 12, 13, 14, 15])  # draft-vocabulary column -> token id
# The toy drafter's next-token probabilities by the token fed (by column; unlisted: ~0).
NEXT = {
    "root": {0: 0.6, 1: 0.3, 2: 0.1},
    10: {3: 0.9, 4: 0.1},
    11: {5: 0.6, 3: 0.4},
    13: {2: 0.7, 4: 0.3},
    15: {0: 1.0},
}


def logits_after(fed) -> torch.Tensor:
    row = torch.full((len(VOCAB),), -30.0)
    for column, prob in NEXT.get(fed, {}).items():
        row[column] = math.log(prob)
    return row


def toy_tree(size: int, calls: list | None = None, min_score: float = 0.0) -> TreeDraft:
    def expand(nodes, features):
        if calls is not None:
            calls.append(list(nodes))
        tokens = [token for _, _, token, _, _ in nodes]
        return features.clone(), torch.stack([logits_after(t) for t in tokens])

    tree = TreeDraft(size, min_score)
    draft_trees([tree], torch.zeros(1, 4), logits_after("root")[None], VOCAB, expand)
    return tree


def test_the_tree_keeps_the_best_scoring_paths_parents_first():
    tokens, parents = toy_tree(size=4).best()
    # scores: 10 (.6), 10-13 (.54), 10-13-12 (.378) and 11 (.3) beat 11-15 (.18)
    assert tokens == [10, 11, 13, 12]
    assert parents == [-1, -1, 0, 2]
    assert depths(parents) == [1, 1, 2, 3]


def test_a_score_floor_leaves_out_the_unlikely_candidates_and_keeps_their_parents():
    tokens, parents = toy_tree(size=4, min_score=0.35).best()
    # 11 (.3) is left out; 10 (.6), 10-13 (.54) and 10-13-12 (.378) stay, a chain.
    assert tokens == [10, 13, 12]
    assert parents == [-1, 0, 1]


def test_each_round_feeds_the_best_new_candidates_within_the_budget():
    calls: list = []
    toy_tree(size=4, calls=calls)
    fed = [[(token, depth) for _, _, token, depth, _ in nodes] for nodes in calls]
    # The root's three children (all among the best 4, all above the floor), then 10-13, the
    # best of their children: 4 feeds, the size's KV slots.
    assert fed == [[(10, 1), (11, 1), (12, 1)], [(13, 2)]]


def test_a_fed_candidate_sees_exactly_its_fed_ancestors_and_itself():
    calls: list = []
    toy_tree(size=4, calls=calls)
    visible = {token: flags for nodes in calls for _, _, token, _, flags in nodes}
    assert visible[10] == (True,)
    assert visible[11] == (False, True)
    assert visible[12] == (False, False, True)
    assert visible[13] == (True, False, False, True)  # fed fourth, child of 10 (fed first)


def test_a_confident_drafter_grows_a_deep_chain():
    tree = TreeDraft(6)

    def expand(nodes, features):
        return features.clone(), torch.stack([logits_after(15) for _ in nodes])

    draft_trees([tree], torch.zeros(1, 4), logits_after(15)[None], VOCAB, expand)
    tokens, parents = tree.best()
    assert tokens == [10] * 6
    assert path_to(parents, 5) == [0, 1, 2, 3, 4, 5]
