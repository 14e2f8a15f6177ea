"""SamplingParams: what a request asks of the sampler, checked once when it is made.

Names and defaults follow vLLM so that clients of the OpenAI-compatible server and users of
the offline API can move between engines without surprises. Validation happens here, at the
edge, so the sampler and scheduler can trust every field without re-checking it per step.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.sampling.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Most top-N logprobs one token may ask for; bounds the per-step topk work and the payload."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily (vLLM's cut-off): softmax(logits / t) is one-hot in
float32 there unless logits nearly tie, and far smaller t overflows logits / t to inf."""

SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds torch.Generator.manual_seed accepts."""


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `n=True` is a caller's mistake, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value: object, allowed: str, ok: Callable[[int], bool]) -> int:
    """`value` as an int satisfying `ok`, else a ValueError naming `name` and `allowed`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int {allowed}, got {type(value).__name__} {value!r}")
    if not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def _float_in(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> float:
    """`value` as a finite float satisfying `ok`; ints are accepted and converted."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number {allowed}, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _optional_logprobs(name: str, value: object) -> int | None:
    if value is None:
        return None
    return _int_in(name, value, f"in [0, {MAX_LOGPROBS}] or None", lambda n: 0 <= n <= MAX_LOGPROBS)


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a str, a list of str or None, got {stop!r}")
    if any(s == "" for s in stops):
        raise ValueError(f"stop strings must be non-empty, got {stop!r}")
    return list(stops)


def _normalise_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list | tuple) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0 or None, got {ids!r}")
    return list(ids)


@dataclass
class SamplingParams:
    """How to pick each next token of one request, and what to report about it.

    `stop` and `stop_token_ids` are normalised to lists, and the float fields to float, so
    downstream code handles one shape. Invalid values raise ValueError naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Keep this prompt's cached prefix blocks for at least this many seconds after use
    # (bounded by the engine's max_retained_kv_fraction); None: plain LRU caching.
    cache_ttl: float | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.n = _int_in("n", self.n, ">= 1", lambda n: n >= 1)
        self.temperature = _float_in("temperature", self.temperature, ">= 0", lambda t: t >= 0)
        self.top_p = _float_in("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        self.top_k = _int_in("top_k", self.top_k, "-1 (disabled) or >= 0", lambda k: k >= -1)
        self.min_p = _float_in("min_p", self.min_p, "in [0, 1]", lambda p: 0 <= p <= 1)
        if self.seed is not None:
            self.seed = _int_in(
                "seed",
                self.seed,
                "in [-2**63, 2**64 - 1] or None",
                lambda s: SEED_RANGE[0] <= s <= SEED_RANGE[1],
            )
        if self.max_tokens is not None:
            self.max_tokens = _int_in(
                "max_tokens", self.max_tokens, ">= 1 or None", lambda n: n >= 1
            )
        limit = self.max_tokens
        self.min_tokens = _int_in(
            "min_tokens",
            self.min_tokens,
            ">= 0" if limit is None else f"in [0, max_tokens={limit}]",
            lambda n: n >= 0 and (limit is None or n <= limit),
        )
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.repetition_penalty = _float_in(
            "repetition_penalty", self.repetition_penalty, "> 0", lambda r: r > 0
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float_in(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2)
            setattr(self, name, value)
        self.logprobs = _optional_logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = _optional_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.cache_ttl is not None:
            self.cache_ttl = _float_in("cache_ttl", self.cache_ttl, "> 0 or None", lambda t: t > 0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams or None, "
                f"got {self.structured_outputs!r}"
            )

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature ~0, or top_k=1 (which keeps only the argmax anyway,
        so taking the greedy path makes it bit-identical to greedy, ties included)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler must look at this request's token history at all."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
