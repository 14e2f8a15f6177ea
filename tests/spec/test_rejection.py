"""Rejection sampling keeps the target distribution exactly (chi-square on a toy p and q)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.spec.rejection import verify_greedy, verify_sampled

NUM_TRIALS = 8_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic, over the categories p gives mass to."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of target probability 0 was emitted"
    total = counts.sum()
    expected = probs[support] * total
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic.double() / 2))


def toy(seed: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a draft q per position, context-free, so every emitted token at position
    i must follow p_i. Some tokens only q proposes and some only p allows."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=gen) ** 2
    q = torch.rand(k, vocab, generator=gen) ** 2
    p[:, 0] = 0.0  # drafted sometimes, never allowed by the target
    q[:, 1] = 0.0  # allowed by the target, never drafted
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def emitted_counts(p, q, deterministic_draft: bool) -> tuple[torch.Tensor, int]:
    k, vocab = q.shape
    gen = torch.Generator().manual_seed(0)
    draft_gen = torch.Generator().manual_seed(1)  # the drafter's randomness is its own
    counts = torch.zeros(k + 1, vocab, dtype=torch.long)
    all_accepted = 0
    for _ in range(NUM_TRIALS):
        if deterministic_draft:
            drafts = [int(t) for t in p[:k].argmax(-1)]  # a good guess, often wrong
            tokens = verify_sampled(p, drafts, None, gen)
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=draft_gen)) for i in range(k)]
            tokens = verify_sampled(p, drafts, q, gen)
        assert 1 <= len(tokens) <= k + 1
        assert tokens[:-1] == drafts[: len(tokens) - 1]
        all_accepted += len(tokens) == k + 1
        for position, token in enumerate(tokens):
            counts[position, token] += 1
    return counts, all_accepted


@pytest.mark.parametrize("deterministic_draft", [False, True], ids=["sampled-q", "one-hot-q"])
def test_emitted_tokens_follow_the_target_distribution_at_every_position(deterministic_draft):
    p, q = toy(seed=0, k=3, vocab=6)
    counts, all_accepted = emitted_counts(p, q, deterministic_draft)
    assert all_accepted > 100, "the bonus path must be exercised"
    for position in range(p.shape[0]):  # the last position is only reached by the bonus draw
        assert chi_square_p_value(counts[position], p[position]) > 0.01


def test_draft_equal_to_target_is_always_accepted():
    p, _ = toy(seed=1, k=2, vocab=5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(2)]
        assert len(verify_sampled(p, drafts, p[:2], gen)) == 3


def test_a_draft_the_target_forbids_is_always_replaced():
    p, _ = toy(seed=2, k=1, vocab=5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        (token,) = verify_sampled(p, [0], None, gen)
        assert token != 0


def test_seeded_verification_is_reproducible():
    p, q = toy(seed=3, k=4, vocab=8)
    drafts = [2, 3, 4, 5]
    runs = [
        [verify_sampled(p, drafts, q, gen) for _ in range(50)]
        for gen in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("target", "drafts", "emitted"),
    [
        ([5, 6, 7, 8], [5, 6, 7], [5, 6, 7, 8]),  # all accepted, then the bonus token
        ([5, 9, 7, 8], [5, 6, 7], [5, 9]),  # first mismatch replaced by the target's choice
        ([4, 6, 7, 8], [5, 6, 7], [4]),
        ([3], [], [3]),  # nothing drafted: a plain decode step
    ],
)
def test_greedy_accepts_exact_matches_only(target, drafts, emitted):
    assert verify_greedy(target, drafts) == emitted
