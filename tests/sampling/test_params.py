"""SamplingParams: vLLM defaults, normalisation, and a named ValueError for every bad field."""

import math

import pytest

from tokenmill.sampling.params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.seed, params.max_tokens, params.min_tokens) == (None, 16, 0)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.0,
        0.0,
        0.0,
    )
    assert (params.logprobs, params.prompt_logprobs) == (None, None)
    assert (params.ignore_eos, params.skip_special_tokens) == (False, True)
    assert params.include_stop_str_in_output is False


def test_stop_string_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_missing_stops_are_normalised_to_empty_lists() -> None:
    params = SamplingParams()
    assert params.stop == []
    assert params.stop_token_ids == []


def test_integer_floats_are_normalised_to_float() -> None:
    params = SamplingParams(temperature=0, top_p=1, repetition_penalty=2)
    assert all(
        type(v) is float for v in (params.temperature, params.top_p, params.repetition_penalty)
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"min_p": 1.0},
        {"top_p": 1e-9},
        {"max_tokens": None, "min_tokens": 10_000},
        {"max_tokens": 4, "min_tokens": 4},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0, "prompt_logprobs": MAX_LOGPROBS},
        {"seed": -1},
        {"stop_token_ids": (0, 7)},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


INVALID = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("temperature", -1.0),
    ("temperature", "hot"),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("seed", "42"),
    ("seed", 1.5),
    ("seed", 2**64),
    ("max_tokens", 0),
    ("max_tokens", "16"),
    ("min_tokens", -1),
    ("min_tokens", 17),  # above the default max_tokens of 16
    ("stop", ""),
    ("stop", ["end", ""]),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 5),
    ("ignore_eos", "yes"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 3),
    ("frequency_penalty", None),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", "5"),
    ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("skip_special_tokens", 1),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_error_message_states_the_allowed_range() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1\.0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0$"):
        SamplingParams(top_p=0)


def test_zero_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).greedy


def test_top_k_one_is_greedy() -> None:
    assert SamplingParams(temperature=0.8, top_k=1).greedy


def test_default_params_sample() -> None:
    assert not SamplingParams().greedy
