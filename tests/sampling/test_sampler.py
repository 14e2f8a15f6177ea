"""Sampler and its logits processors on fixed logits: no model involved."""

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from tokenmill.sampling.logits_processors import (
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    apply_top_k_top_p,
    token_counts,
)
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.sampler import Sampler, SamplingRow, make_generator

CHI2_CRITICAL_DF7_P01 = 18.475
"""Chi-square critical value for 7 degrees of freedom (8 categories) at p = 0.01, from the
standard table (scipy.stats.chi2.ppf(0.99, 7) = 18.4753). Every random draw below is seeded,
so each statistical test is deterministic rather than failing 1% of the time."""

NUM_DRAWS = 20_000


def make_row(
    params: SamplingParams | None = None,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    generator: torch.Generator | None = None,
    eos: frozenset[int] = frozenset(),
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        prompt_token_ids=prompt,
        output_token_ids=output,
        generator=generator,
        eos_token_ids=eos,
    )


def sample_many(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> Counter[int]:
    """Token frequencies of `draws` independent samples from one logits vector."""
    torch.manual_seed(0)
    rows = [make_row(params) for _ in range(draws)]
    return Counter(Sampler()(logits_row.expand(draws, -1).clone(), rows).token_ids)


def chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    expected = probs.double() * sum(counts.values())
    observed = torch.tensor([counts[i] for i in range(len(probs))], dtype=torch.float64)
    return float(((observed - expected) ** 2 / expected).sum())


def permuted_logits(probs: list[float]) -> tuple[torch.Tensor, list[int]]:
    """Logits for `probs` placed at shuffled token ids, so support checks exercise the sort;
    also returns the token id holding each entry of `probs`."""
    token_of = torch.randperm(len(probs), generator=torch.Generator().manual_seed(3)).tolist()
    logits = torch.full((len(probs),), 0.0)
    logits[token_of] = torch.tensor(probs).log()
    return logits, token_of


# --- greedy -----------------------------------------------------------------------------


def test_zero_temperature_takes_the_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_ties_go_to_the_first_maximum() -> None:
    logits = torch.zeros(3, 50_000)
    logits[0, [7, 3, 40_000]] = 5.0
    logits[2, [49_999, 12_345]] = 1.0
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler()(logits, rows).token_ids == [3, 0, 12_345]


def test_top_k_one_equals_greedy_on_random_logits() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1))
    greedy = [make_row(SamplingParams(temperature=0.0)) for _ in range(64)]
    top1 = [make_row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(64)]
    assert Sampler()(logits, top1).token_ids == Sampler()(logits, greedy).token_ids


def test_sampler_leaves_the_logits_untouched() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = SamplingParams(top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3, min_tokens=2)
    Sampler()(logits, [make_row(params, prompt=[1, 2], eos=frozenset({0}))] * 3)
    assert torch.equal(logits, before)


def test_bfloat16_logits_give_what_their_float32_widening_gives() -> None:
    """A bfloat16 model's logits reach the sampler as they are: greedy rows take their argmax
    without a copy, and every row that computes (penalties, min_tokens, draws, logprobs) does so
    on the exact float32 widening, so tokens and logprobs come out the same."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)).bfloat16()
    logits[0, [5, 9]] = 7.0  # a tie: the first maximum wins either way
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(seed=7, temperature=0.8, top_k=50, logprobs=1),
        SamplingParams(seed=8, top_p=0.9, frequency_penalty=0.5),
    ]

    def run(x: torch.Tensor) -> tuple[list[int], list]:
        rows = [
            make_row(
                p, prompt=[1, 2], output=[3], generator=make_generator(p.seed), eos=frozenset({4})
            )
            for p in params
        ]
        out = Sampler()(x, rows)
        return out.token_ids, out.logprobs

    assert run(logits) == run(logits.float())
    assert run(logits)[0][0] == 5


# --- seeds ------------------------------------------------------------------------------


SEEDED = SamplingParams(seed=1234, temperature=0.9)


def seeded_run(
    steps: int,
    logits: torch.Tensor,
    companions: list[SamplingRow],
    params: SamplingParams = SEEDED,
) -> list[int]:
    """Tokens of one seeded row over `steps` steps, batched after `companions`."""
    seeded = make_row(params, generator=make_generator(params.seed))
    tokens = []
    for _ in range(steps):
        rows = [*companions, seeded]
        out = Sampler()(logits[: len(rows)], rows)
        tokens.append(out.token_ids[-1])
    return tokens


def flat_logits(rows: int) -> torch.Tensor:
    return 0.3 * torch.randn(rows, 50, generator=torch.Generator().manual_seed(5))


def test_seeded_row_repeats_exactly() -> None:
    first = seeded_run(30, flat_logits(1), [])
    assert seeded_run(30, flat_logits(1), []) == first
    assert len(set(first)) > 5  # actually random, not stuck on one token


@pytest.mark.parametrize(
    "params",
    [SEEDED, SamplingParams(seed=1234, top_k=20, top_p=0.9, min_p=0.05)],
    ids=["untruncated", "truncated"],
)
def test_seeded_row_is_unaffected_by_other_rows_in_the_batch(params: SamplingParams) -> None:
    companions = [
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(top_k=3)),
        make_row(SamplingParams(top_p=0.5, min_p=0.2)),
        make_row(SamplingParams(seed=99), generator=make_generator(99)),
        make_row(SamplingParams(repetition_penalty=1.5, min_tokens=3), prompt=[1, 2, 3]),
    ]
    logits = flat_logits(len(companions) + 1)
    alone = seeded_run(30, logits[-1:], [], params)
    batched = seeded_run(30, logits, companions, params)
    assert batched == alone


def test_different_seeds_give_different_tokens() -> None:
    logits = flat_logits(1)
    row_a = make_row(generator=make_generator(1))
    row_b = make_row(generator=make_generator(2))
    a = [Sampler()(logits, [row_a]).token_ids[0] for _ in range(40)]
    b = [Sampler()(logits, [row_b]).token_ids[0] for _ in range(40)]
    assert a != b


def test_unseeded_row_gets_no_generator() -> None:
    assert make_generator(None) is None


# --- distribution -----------------------------------------------------------------------

EIGHT_LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.3, 0.8, -1.0, 0.2, -0.6])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_samples_follow_the_tempered_softmax(temperature: float) -> None:
    counts = sample_many(EIGHT_LOGITS, SamplingParams(temperature=temperature), NUM_DRAWS)
    expected = (EIGHT_LOGITS / temperature).softmax(dim=-1)
    assert chi_square(counts, expected) < CHI2_CRITICAL_DF7_P01


def test_seeded_rows_follow_the_softmax() -> None:
    rows = [make_row(generator=make_generator(seed)) for seed in range(NUM_DRAWS)]
    logits = EIGHT_LOGITS.expand(NUM_DRAWS, -1).clone()
    counts = Counter(Sampler()(logits, rows).token_ids)
    assert chi_square(counts, EIGHT_LOGITS.softmax(dim=-1)) < CHI2_CRITICAL_DF7_P01


def test_an_unlikely_distribution_fails_the_chi_square_test() -> None:
    """Guards the test above: the statistic must be able to reject a wrong distribution."""
    counts = sample_many(EIGHT_LOGITS, SamplingParams(temperature=0.8), NUM_DRAWS)
    assert chi_square(counts, EIGHT_LOGITS.softmax(dim=-1)) > CHI2_CRITICAL_DF7_P01


# --- truncation -------------------------------------------------------------------------

FIVE_PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def sampled_support(probs: list[float], params: SamplingParams) -> set[int]:
    """Which entries of `probs` (by position) were ever sampled in 5000 draws."""
    logits, token_of = permuted_logits(probs)
    counts = sample_many(logits, params, 5000)
    return {token_of.index(token) for token in counts}


def test_top_k_samples_only_the_k_most_likely_tokens() -> None:
    assert sampled_support(FIVE_PROBS, SamplingParams(top_k=3)) == {0, 1, 2}


def test_top_p_samples_only_the_smallest_set_reaching_p() -> None:
    # cumulative mass 0.4, 0.7, 0.85: three tokens are needed to reach 0.8
    assert sampled_support(FIVE_PROBS, SamplingParams(top_p=0.8)) == {0, 1, 2}


def test_top_p_applies_to_the_distribution_left_by_top_k() -> None:
    # after top_k=2 the top token holds 0.4 / 0.7 = 0.57 >= 0.5 of the mass alone
    assert sampled_support(FIVE_PROBS, SamplingParams(top_k=2, top_p=0.5)) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    # 0.2 * 0.4 = 0.08: keeps 0.4, 0.3, 0.15, 0.1, drops 0.05
    assert sampled_support(FIVE_PROBS, SamplingParams(min_p=0.2)) == {0, 1, 2, 3}


def test_disabled_truncation_can_sample_every_token() -> None:
    assert sampled_support(FIVE_PROBS, SamplingParams(top_k=-1)) == {0, 1, 2, 3, 4}


def test_disabled_truncation_returns_peaked_logits_bit_for_bit() -> None:
    """In float32 the cumulative mass of a peaked 32k vocabulary reaches 1.0 long before its
    tail; top_p = 1 must still keep that tail."""
    logits = 5 * torch.randn(4, 32_000, generator=torch.Generator().manual_seed(0))
    kept = apply_top_k_top_p(logits, torch.full((4,), 32_000), torch.ones(4))
    assert torch.equal(kept, logits)


# --- penalties --------------------------------------------------------------------------


def test_token_counts_counts_each_rows_history() -> None:
    counts = token_counts([[1, 1, 3], [], [0]], vocab_size=4, device=torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_token_counts_ignores_ids_outside_the_vocabulary() -> None:
    counts = token_counts([[2, 9]], vocab_size=3, device=torch.device("cpu"))
    assert counts.tolist() == [[0, 0, 1]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    penalised = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert penalised.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_frequency_and_presence_penalties_subtract_by_count_and_by_appearance() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    counts = torch.tensor([[0, 3, 1], [2, 0, 0]])
    penalised = apply_frequency_presence_penalties(
        logits, counts, frequency=torch.tensor([0.5, 0.0]), presence=torch.tensor([0.25, -1.0])
    )
    assert penalised.tolist() == [[1.0, -0.75, 0.25], [2.0, 1.0, 1.0]]


def greedy_pick(logits: list[float], params: SamplingParams, **history: Sequence[int]) -> int:
    return Sampler()(torch.tensor([logits]), [make_row(params, **history)]).token_ids[0]


def test_repetition_penalty_covers_prompt_tokens() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert greedy_pick([3.0, 2.0], params, prompt=[0]) == 1  # 3 / 2 < 2


def test_presence_penalty_ignores_prompt_tokens() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert greedy_pick([3.0, 2.0], params, prompt=[0]) == 0


def test_presence_penalty_covers_output_tokens() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert greedy_pick([3.0, 2.0], params, output=[0]) == 1  # 3 - 2 < 2


def test_frequency_penalty_grows_with_repeats() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    assert greedy_pick([3.0, 2.0], params, output=[0, 0]) == 0  # 3 - 0.8 > 2
    assert greedy_pick([3.0, 2.0], params, output=[0, 0, 0]) == 1  # 3 - 1.2 < 2


def test_rows_without_penalties_are_not_penalised() -> None:
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    plain = SamplingParams(temperature=0.0)
    logits = torch.tensor([[3.0, 2.0], [3.0, 2.0]])
    rows = [make_row(penalised, prompt=[0]), make_row(plain, prompt=[0])]
    assert Sampler()(logits, rows).token_ids == [1, 0]


# --- min_tokens -------------------------------------------------------------------------

EOS_LOGITS = [0.0, 0.5, 9.0, 8.0]  # token 2 is EOS, token 3 a stop token; both dominate


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_tokens_until_reached(ignore_eos: bool) -> None:
    params = SamplingParams(
        temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=ignore_eos
    )
    eos = frozenset({2})
    assert greedy_pick(EOS_LOGITS, params, output=[0, 0], eos=eos) == 1
    assert greedy_pick(EOS_LOGITS, params, output=[0, 0, 0], eos=eos) == 2


def test_min_tokens_masking_holds_for_sampled_rows() -> None:
    params = SamplingParams(min_tokens=1, stop_token_ids=[3])
    rows = [make_row(params, eos=frozenset({2})) for _ in range(500)]
    logits = torch.tensor([EOS_LOGITS]).expand(500, -1).clone()
    assert set(Sampler()(logits, rows).token_ids) <= {0, 1}


def test_min_tokens_ignores_eos_ids_beyond_the_vocabulary() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=1)
    assert greedy_pick(EOS_LOGITS, params, eos=frozenset({2, 100})) == 3


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_absent_unless_asked_for() -> None:
    out = Sampler()(torch.zeros(2, 5), [make_row(), make_row()])
    assert out.logprobs == [None, None]


def test_top_logprobs_are_the_sorted_top_n_of_log_softmax() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(7))
    rows = [make_row(SamplingParams(logprobs=5)), make_row(SamplingParams(logprobs=2))]
    out = Sampler()(logits, rows)
    for row_logits, n, result in zip(logits, [5, 2], out.logprobs, strict=True):
        assert result is not None
        expected = row_logits.log_softmax(dim=-1)
        values, ids = expected.topk(n)
        assert [t for t, _ in result.top] == ids.tolist()
        assert [v for _, v in result.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_sampled_token_logprob_and_rank_match_log_softmax() -> None:
    logits = torch.randn(200, 30, generator=torch.Generator().manual_seed(8))
    rows = [make_row(SamplingParams(logprobs=0)) for _ in range(200)]
    torch.manual_seed(0)
    out = Sampler()(logits, rows)
    for row_logits, token, result in zip(logits, out.token_ids, out.logprobs, strict=True):
        assert result is not None
        expected = row_logits.log_softmax(dim=-1)
        order = expected.argsort(descending=True).tolist()
        assert (result.token_id, result.rank) == (token, order.index(token) + 1)
        assert result.logprob == pytest.approx(expected[token].item(), abs=1e-6)
        assert result.top == []
    assert {r.rank for r in out.logprobs if r is not None} != {1}  # not only argmax tokens


def test_logprobs_describe_the_raw_model_distribution() -> None:
    """EOS is masked by min_tokens, yet its raw probability still ranks first."""
    params = SamplingParams(temperature=0.0, min_tokens=1, logprobs=1)
    out = Sampler()(torch.tensor([EOS_LOGITS]), [make_row(params, eos=frozenset({2}))])
    result = out.logprobs[0]
    assert result is not None
    raw = torch.tensor(EOS_LOGITS).log_softmax(dim=-1)
    assert (result.token_id, result.rank) == (3, 2)
    assert result.logprob == pytest.approx(raw[3].item())
    assert result.top == [(2, pytest.approx(raw[2].item()))]
