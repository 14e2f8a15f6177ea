"""Pure functions that reshape a batch of next-token logits before a token is picked.

Each takes `[rows, vocab]` float logits plus one value per row and returns new logits; none
modifies its input, so the sampler can still report logprobs of the model's own output.
A token is removed by setting its logit to -inf, which softmax turns into probability 0.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each vocabulary id occurs in each row's history, as `[rows, vocab]` int64.

    Rows are padded with an extra bucket (`vocab_size`) that is dropped at the end, so
    histories of different lengths become one scatter instead of a loop over rows.
    """
    longest = max((len(ids) for ids in token_ids), default=0)
    padded = [
        [min(t, vocab_size) for t in ids] + [vocab_size] * (longest - len(ids)) for ids in token_ids
    ]
    index = torch.tensor(padded, dtype=torch.long, device=device).view(len(token_ids), longest)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index))
    return counts[:, :vocab_size]


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Forbid `tokens[i]` in row `rows[i]` for every i (e.g. EOS before min_tokens)."""
    masked = logits.clone()
    masked[rows, tokens] = float("-inf")
    return masked


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """CTRL / HF repetition penalty on tokens already in the prompt or output (`seen`).

    Dividing a positive logit and multiplying a negative one both make the token less
    likely for penalty > 1 (a plain division would make negative logits *more* likely).
    """
    per_row = penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / per_row, logits * per_row)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """OpenAI-style additive penalties over generated tokens only: frequency scales with the
    count, presence is a flat charge for having appeared at all."""
    return (
        logits
        - frequency.unsqueeze(1) * output_counts
        - presence.unsqueeze(1) * (output_counts > 0)
    )


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Sharpen (< 1) or flatten (> 1) each row's distribution; temperature must be > 0."""
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep each row's `top_k` most likely tokens, then the fewest of those whose mass
    reaches `top_p` (renormalised after top-k, as vLLM does).

    One descending sort serves both. Pass `top_k >= vocab` and `top_p >= 1` to disable them
    for a row; a disabled row is returned bit-for-bit unchanged, which keeps seeded rows
    reproducible whatever else shares the batch.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_above = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    p = top_p.unsqueeze(1)
    # Rounding can push the cumulative sum to 1.0 early; `p < 1` keeps disabled rows whole.
    outside_p = (mass_above >= p) & (p < 1)
    sorted_logits = sorted_logits.masked_fill(outside_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the row's top probability.

    Compared in log space (logit - max_logit < log(min_p)) so no softmax is needed; min_p = 0
    gives log 0 = -inf and keeps every token.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))
