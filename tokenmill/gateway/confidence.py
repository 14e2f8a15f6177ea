"""How sure a model was of its answer: the mean or the minimum log-probability of the tokens it
chose (the cascade's escalation signal)."""

from __future__ import annotations

import math

from tokenmill.engine.outputs import RequestOutput

CONFIDENCE_METRICS = ("mean", "min")


def token_logprobs(output: RequestOutput) -> list[float]:
    return [lp.logprob for c in output.outputs for lp in (c.logprobs or [])]


def confidence(output: RequestOutput, metric: str) -> float:
    """The answer's confidence; -inf when it carries no token logprobs."""
    values = token_logprobs(output)
    if not values:
        return -math.inf
    if metric == "mean":
        return sum(values) / len(values)
    if metric == "min":
        return min(values)
    raise ValueError(f"confidence metric must be one of {CONFIDENCE_METRICS}, got {metric!r}")
