"""The sampler: one call per engine step turns a batch of logits into one token per row.

Order (as vLLM): min_tokens masking -> penalties -> greedy rows take the argmax; the other
rows get temperature -> top-k -> top-p -> min-p and are sampled. Logprobs are reported
from the *raw* logits the model produced (vLLM's default): they describe what the model
believed, not the knobs a request turned, so they are comparable across requests.

Sampling draws one Exp(1) variable per vocabulary entry and takes argmax(p / noise), an
exponential race that picks token i with probability p_i. A seeded row draws its noise only
from its own generator, so its tokens do not depend on which other rows share the batch.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.kernels import ops
from tokenmill.sampling.logits_processors import (
    apply_frequency_presence_penalties,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k_top_p,
    mask_tokens,
    token_counts,
)
from tokenmill.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample a token for, with the history that penalties need.

    `eos_token_ids` (with `params.stop_token_ids`) are masked while fewer than
    `params.min_tokens` tokens have been generated, whatever `ignore_eos` says: min_tokens
    is a promise about length, and ignore_eos only stops the scheduler from ending on EOS.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability under the raw model distribution, its rank there
    (1 = most likely), and the top-N alternatives, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One token per row, and per row its logprobs when the row's params asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A per-sequence RNG for a seeded request; None means "use the global RNG"."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Stateless: everything a step needs arrives in its `rows`."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Pick one token per row of `logits [len(rows), vocab]`, left unmodified: float32, or
        the model's own dtype, widened only for the rows and steps that compute with them."""
        processed = adjust_logits(logits, rows)
        token_ids = ops.row_argmax(processed)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            token_ids[random_rows] = _sample(processed[random_rows], [rows[i] for i in random_rows])
        ids = token_ids.tolist()
        return SamplerOutput(token_ids=ids, logprobs=_token_logprobs(logits, ids, rows))


def adjust_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits a greedy row takes the argmax of: min_tokens masking, then penalties, in
    float32. A batch that needs neither gets `logits` back as they came, in the model's dtype:
    their argmax is the widened logits' argmax, without the copy."""
    return _apply_penalties(_mask_before_min_tokens(logits, rows), rows)


def _mask_before_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    pairs = [
        (i, token)
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
        for token in row.eos_token_ids.union(row.params.stop_token_ids or ())
        if token < vocab_size  # an id the model cannot emit needs no mask
    ]
    if not pairs:
        return logits
    row_idx, token_idx = zip(*pairs, strict=True)
    return mask_tokens(
        logits.float(),
        torch.tensor(row_idx, device=logits.device),
        torch.tensor(token_idx, device=logits.device),
    )


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalise only the rows that ask for it; histories of the rest are never read."""
    idx = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if not idx:
        return logits
    logits = logits.float()
    params = [rows[i].params for i in idx]
    vocab_size, device = logits.shape[-1], logits.device
    output_counts = token_counts([rows[i].output_token_ids for i in idx], vocab_size, device)
    penalised = logits[idx]
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = token_counts([rows[i].prompt_token_ids for i in idx], vocab_size, device)
        penalised = apply_repetition_penalty(
            penalised,
            seen=(prompt_counts + output_counts) > 0,
            penalty=_per_row([p.repetition_penalty for p in params], device),
        )
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        penalised = apply_frequency_presence_penalties(
            penalised,
            output_counts,
            frequency=_per_row([p.frequency_penalty for p in params], device),
            presence=_per_row([p.presence_penalty for p in params], device),
        )
    result = logits.clone()
    result[idx] = penalised
    return result


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, truncation, then one exponential-race draw per row (none greedy)."""
    probs = sampling_probs(logits, rows)
    return (probs / _exponential_noise(probs.shape, rows, probs.device)).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution a non-greedy row draws from, given its adjusted logits: temperature,
    then top-k, top-p and min-p truncation, then softmax, in float32."""
    params = [row.params for row in rows]
    vocab_size, device = logits.shape[-1], logits.device
    logits = apply_temperature(logits.float(), _per_row([p.temperature for p in params], device))
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        logits = apply_top_k_top_p(
            logits,
            torch.tensor(top_k, device=device),
            _per_row(top_p, device),
        )
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, _per_row([p.min_p for p in params], device))
    return logits.softmax(dim=-1)


def _exponential_noise(
    shape: torch.Size, rows: Sequence[SamplingRow], device: torch.device
) -> torch.Tensor:
    noise = torch.empty(shape, device=device)
    if any(row.generator is None for row in rows):
        noise.exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i].exponential_(generator=row.generator)
    # Exp(1) may round to 0; a zero would hand the race to a token of probability 0.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _token_logprobs(
    logits: torch.Tensor, token_ids: list[int], rows: Sequence[SamplingRow]
) -> list[TokenLogprobs | None]:
    idx = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not idx:
        return result
    entries = token_logprobs(
        logits[idx], [token_ids[i] for i in idx], [rows[i].params.logprobs or 0 for i in idx]
    )
    for i, entry in zip(idx, entries, strict=True):
        result[i] = entry
    return result


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Logprob and rank of `token_ids[i]` under row i of raw `logits`, with its top `num_top[i]`.

    Shared by sampled tokens and prompt tokens (where row i is the logits that predicted
    prompt token i + 1), so both report the same numbers for the same distribution.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_ids = torch.tensor(token_ids, device=logits.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen_ids)
    ranks = ((logprobs > chosen_logprobs).sum(dim=-1) + 1).tolist()
    chosen = chosen_logprobs.squeeze(1).tolist()
    top_values, top_ids = (t.tolist() for t in logprobs.topk(max(num_top), dim=-1))
    return [
        TokenLogprobs(
            token_id=token_ids[j],
            logprob=chosen[j],
            rank=ranks[j],
            top=list(zip(top_ids[j][:n], top_values[j][:n], strict=True)),
        )
        for j, n in enumerate(num_top)
    ]


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
