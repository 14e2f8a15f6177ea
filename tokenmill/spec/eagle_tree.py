"""EAGLE-2's dynamic draft tree (Li et al., 2024): its shape follows the drafter's confidence.

A candidate's score is the product of the drafter's probabilities down its path, an estimate of
the chance the target accepts it. The root's top tokens are the first candidates; each round
feeds the best candidates not yet fed through the drafter (one batched pass for every request),
and their top tokens become their children; at the end the `size` best candidates are the tree
the target verifies (tokenmill/draft_tree.py). A child never scores above its parent and is
created after it, so the best `size` hold every parent of theirs, and in creation order
parents come first.

A round feeds only candidates among the `size` best so far (a child of any other could not make
the tree) and scoring at least MIN_FEED_SCORE, at most BRANCH of them per request: a confident
drafter's budget goes into depth, an unsure one's into breadth near the root. Each fed candidate
takes one of the drafter's KV slots past the request's real tokens; the scheduler reserves
`size` of them, the budget of feeds. The drafter itself is a callable (`Expand`), so this
module holds no model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

CHILDREN = 4
"""Top tokens of the drafter that become an expanded candidate's children."""
BRANCH = 4
"""Candidates of a request fed per round: each round is a pass of the drafter, whose cost
hardly grows with its rows, so feeding as many as CHILDREN at once spends the feed budget in
fewer passes than feeding 2 did, at the same acceptance on the chat workloads."""
MIN_FEED_SCORE = 0.02
"""Below this estimated chance of acceptance a candidate's children are not worth a feed."""

# One round's fed candidates, each `(request, fed index, token, depth, visible)` (`visible`:
# flags over the request's fed candidates 0..fed index, its ancestors and itself), and the
# features they read (their parents' predicted ones, a row each) -> (their predicted features,
# their draft-vocabulary logits), a row each.
Expand = Callable[
    [Sequence[tuple[int, int, int, int, tuple[bool, ...]]], torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass
class _Candidate:
    token: int
    parent: int  # index of its parent candidate; -1: a child of the root
    score: float
    depth: int
    fed: int = -1  # its index among the fed candidates; -1: not fed


@dataclass
class TreeDraft:
    """One request's candidates as they grow."""

    size: int  # the most drafts to keep, and the most candidates to feed
    min_score: float = 0.0  # the least score a kept draft has
    candidates: list[_Candidate] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # candidate indices, in feed order

    def add_children(self, parent: int, tokens: Sequence[int], probs: Sequence[float]) -> None:
        above = self.candidates[parent] if parent >= 0 else None
        for token, prob in zip(tokens, probs, strict=True):
            score = prob if above is None else above.score * prob
            depth = 1 if above is None else above.depth + 1
            self.candidates.append(_Candidate(token, parent, score, depth))

    def to_expand(self) -> list[int]:
        """The candidates worth feeding next: not fed yet, among the best `size` so far and
        scoring at least MIN_FEED_SCORE, best first, at most BRANCH and what is left of the
        feed budget."""
        chosen = [
            i
            for i in self._best()
            if self.candidates[i].fed < 0 and self.candidates[i].score >= MIN_FEED_SCORE
        ]
        return chosen[: min(BRANCH, self.size - len(self.fed))]

    def feed(self, index: int) -> tuple[int, tuple[bool, ...]]:
        """Marks a candidate fed: (its fed index, its flags over the fed candidates so far)."""
        candidate = self.candidates[index]
        candidate.fed = len(self.fed)
        self.fed.append(index)
        on_path = set()
        node = index
        while node >= 0:
            on_path.add(self.candidates[node].fed)
            node = self.candidates[node].parent
        return candidate.fed, tuple(j in on_path for j in range(candidate.fed + 1))

    def best(self) -> tuple[list[int], list[int]]:
        """The tree: the `size` best candidates scoring at least `min_score`, in creation
        order, (tokens, parents). A child never scores above its parent, so the parents of
        those kept are kept."""
        kept = sorted(i for i in self._best() if self.candidates[i].score >= self.min_score)
        position = {index: i for i, index in enumerate(kept)}
        tokens = [self.candidates[i].token for i in kept]
        parents = [
            position[self.candidates[i].parent] if self.candidates[i].parent >= 0 else -1
            for i in kept
        ]
        return tokens, parents

    def _rank(self, index: int) -> tuple[float, int]:
        return (-self.candidates[index].score, index)

    def _best(self) -> list[int]:
        return sorted(range(len(self.candidates)), key=self._rank)[: self.size]


def draft_trees(
    trees: Sequence[TreeDraft],
    predicted: torch.Tensor,
    logits: torch.Tensor,
    vocab: torch.Tensor,
    expand: Expand,
) -> None:
    """Grows every request's tree from its root's predicted feature and logits (a row of
    `predicted` and `logits` each), one batched `expand` per round, until no request has a
    candidate worth feeding. `vocab` maps logit columns to token ids."""
    _add_children(trees, [(r, -1) for r in range(len(trees))], logits, vocab)
    features = {(r, -1): predicted[r] for r in range(len(trees))}  # (request, candidate) -> row
    while True:
        round_nodes, inputs = [], []
        for r, tree in enumerate(trees):
            for index in tree.to_expand():
                fed, visible = tree.feed(index)
                candidate = tree.candidates[index]
                round_nodes.append((r, index, fed, candidate, visible))
                inputs.append(features[(r, candidate.parent)])
        if not round_nodes:
            return
        out, round_logits = expand(
            [(r, fed, c.token, c.depth, visible) for r, _, fed, c, visible in round_nodes],
            torch.stack(inputs),
        )
        for row, (r, index, _, _, _) in enumerate(round_nodes):
            features[(r, index)] = out[row]
        _add_children(trees, [(r, index) for r, index, *_ in round_nodes], round_logits, vocab)


def _add_children(
    trees: Sequence[TreeDraft],
    parents: Sequence[tuple[int, int]],
    logits: torch.Tensor,
    vocab: torch.Tensor,
) -> None:
    """Each (request, candidate) row of `logits` gives that candidate its top tokens."""
    top = logits.float().softmax(dim=-1).topk(min(CHILDREN, logits.shape[-1]), dim=-1)
    tokens, probs = vocab[top.indices].tolist(), top.values.tolist()
    for (r, parent), row_tokens, row_probs in zip(parents, tokens, probs, strict=True):
        trees[r].add_children(parent, row_tokens, row_probs)
