"""Verification of drafted tokens that keeps the target model's output distribution exact.

A proposer drafts x_1..x_k from distributions q_1..q_k; the target scores all of them in one
forward pass, giving p_1..p_{k+1} (p_{k+1} follows the last draft). Leviathan et al. and Chen
et al. (2023) show that accepting x_i with probability min(1, p_i(x_i) / q_i(x_i)), replacing
the first rejected draft with a draw from norm(max(0, p_i - q_i)) and, when all k pass, adding
a bonus draw from p_{k+1}, emits tokens distributed exactly as drawing from p one at a time.

A proposer that drafts deterministically (prompt lookup, a greedy draft model, an EAGLE head)
is the case q_i = one-hot(x_i): x_i is accepted with probability p_i(x_i), and the residual is
p_i without x_i. Drawing t_i from p_i first and accepting x_i exactly when t_i = x_i has those
very probabilities, and it draws the same random numbers, one exponential race per emitted
token, that plain decoding draws: a seeded request then emits the same tokens with or without
speculation. A greedy request accepts a draft exactly when it equals the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.draft_tree import is_chain
from tokenmill.kernels import ops
from tokenmill.sampling.sampler import SamplingRow, adjust_logits, sampling_probs
from tokenmill.spec.tree import verify_tree


@dataclass
class DraftsToVerify:
    """One request's drafts and the sampling context of each of its k + 1 positions: the
    history of position i includes drafts 0..i-1, so penalties and min_tokens apply as they
    would have one token at a time."""

    draft_token_ids: Sequence[int]
    rows: Sequence[SamplingRow]
    draft_probs: torch.Tensor | None = None  # what drawn drafts came from; None: one-hot
    parents: Sequence[int] = ()  # a draft tree's shape (tokenmill/spec/tree.py); (): a chain


class RejectionSampler:
    """Verifies the drafts of several requests from one batch of target logits."""

    def __call__(self, logits: torch.Tensor, batch: Sequence[DraftsToVerify]) -> list[list[int]]:
        """`logits [sum of k_i + 1, vocab]`: the target's raw logits at every position of every
        request, in order. Returns the tokens each request emits."""
        rows = [row for item in batch for row in item.rows]
        adjusted = adjust_logits(logits, rows)
        argmax = ops.row_argmax(adjusted).tolist()
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            probs = sampling_probs(adjusted[random_rows], [rows[i] for i in random_rows])
        emitted: list[list[int]] = []
        start = random_start = 0
        for item in batch:
            stop = start + len(item.rows)
            first = item.rows[0]
            if first.params.greedy:
                item_argmax = argmax[start:stop]
                if is_chain(item.parents):
                    emitted.append(verify_greedy(item_argmax, item.draft_token_ids))
                else:
                    pick = item_argmax.__getitem__
                    emitted.append(verify_tree(item.parents, item.draft_token_ids, pick)[0])
            else:
                item_probs = probs[random_start : random_start + len(item.rows)]
                random_start += len(item.rows)
                emitted.append(verify_sampled_item(item, item_probs, first.generator))
            start = stop
        return emitted


def verify_sampled_item(
    item: DraftsToVerify, target_probs: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    """A sampled request's chain (`verify_sampled`) or tree of one-hot drafts (`verify_tree`
    with one draw from p at each node it reaches)."""
    if is_chain(item.parents):
        return verify_sampled(target_probs, item.draft_token_ids, item.draft_probs, generator)
    if item.draft_probs is not None:
        raise ValueError("a draft tree is verified only with one-hot drafts")

    def pick(row: int) -> int:
        return _draw(target_probs[row], generator)

    return verify_tree(item.parents, item.draft_token_ids, pick)[0]


def verify_greedy(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """The tokens a greedy request emits: drafts while each equals the target's choice at its
    position, then the target's own choice at the first mismatch (or after the last draft).

    `target_token_ids` holds the target's argmax at each of the k + 1 positions."""
    matched = 0
    for target, draft in zip(target_token_ids, draft_token_ids, strict=False):
        if target != draft:
            break
        matched += 1
    return [*draft_token_ids[:matched], target_token_ids[matched]]


def verify_sampled(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a sampled request emits: the accepted drafts, then one token from the residual
    of the first rejection or the bonus draw. Between 1 and k + 1 tokens.

    `target_probs [k + 1, vocab]`: the request's final sampling distribution (after its
    temperature, top-k/top-p/min-p and penalties) at each position. `draft_probs [k, vocab]`:
    the distributions the drafts were drawn from, or None for deterministic drafts. Random
    numbers come from `generator` (the request's own when it is seeded).
    """
    k = len(draft_token_ids)
    if draft_probs is None:
        for i in range(k + 1):
            token = _draw(target_probs[i], generator)
            if i == k or token != draft_token_ids[i]:
                return [*draft_token_ids[:i], token]
    assert draft_probs is not None
    drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=target_probs.device)
    p = target_probs[:k].gather(1, drafts.unsqueeze(1)).squeeze(1)
    q = draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
    uniform = torch.rand(k, generator=generator, device=target_probs.device)
    # u < p / q, written without the division: q > 0 for a drafted token, p may be 0.
    rejected = (uniform * q >= p).nonzero()
    if len(rejected) == 0:
        return [*draft_token_ids, _draw(target_probs[k], generator)]
    first = int(rejected[0])
    residual = (target_probs[first] - draft_probs[first]).clamp_min_(0.0)
    if not residual.sum() > 0:  # p == q up to rounding: a rejection had probability ~0
        residual = target_probs[first]
    return [*draft_token_ids[:first], _draw(residual, generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index with probability proportional to `weights`: the exponential race the sampler
    runs, drawing the same numbers from `generator`."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax())
