"""Routes: one name (`"model": "auto"`) in front of a small and a large model, and the policy
that picks which answers each request.

- `cascade`: the small model answers; when its confidence (mean or minimum token logprob) is
  under the threshold, the large model answers instead.
- `random`: the large model answers a `threshold` share of requests (the baseline any router
  must beat at the same share).
- `classifier`: the large model answers when a classifier over the prompt's embedding gives a
  probability of at least `threshold` that the small model is not good enough.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.engine.async_engine import AsyncLLMEngine, RequestStream
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.gateway.classifier import RouteClassifier
from tokenmill.gateway.confidence import CONFIDENCE_METRICS, confidence
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.streams import ReplayStream, record
from tokenmill.sampling.params import SamplingParams

POLICIES = ("cascade", "random", "classifier")
DEFAULT_THRESHOLDS = {"cascade": -1.0, "random": 0.5, "classifier": 0.5}
"""The cascade's is a mean token logprob, from `tokenmill router calibrate` on the packaged pair
(docs/routing-and-caching.md); the others are a share and a probability."""


@dataclass(frozen=True)
class RouteSpec:
    name: str
    policy: str
    small: str
    large: str
    threshold: float
    metric: str = "mean"  # cascade: which confidence
    classifier: str | None = None  # classifier: the file `tokenmill router train` wrote
    seed: int = 0  # random: the draws

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"route {self.name}: policy must be one of {POLICIES}")
        if self.small == self.large:
            raise ValueError(f"route {self.name}: small and large must be two models")
        if self.metric not in CONFIDENCE_METRICS:
            raise ValueError(f"route {self.name}: metric must be one of {CONFIDENCE_METRICS}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"route {self.name}: threshold must be a finite number")
        if self.policy == "cascade" and self.threshold > 0:
            raise ValueError(
                f"route {self.name}: a cascade threshold is a token logprob, <= 0, "
                f"got {self.threshold}"
            )
        if self.policy != "cascade" and not 0 <= self.threshold <= 1:
            raise ValueError(
                f"route {self.name}: a {self.policy} threshold must be in [0, 1], "
                f"got {self.threshold}"
            )
        if self.policy == "classifier" and not self.classifier:
            raise ValueError(f"route {self.name}: the classifier policy needs a classifier file")


def route_spec(name: str, entry: Any, models: Sequence[str], where: str) -> RouteSpec:
    """A RouteSpec from a config entry; its models must be among `models`."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a table")
    policy = entry.get("policy", "cascade")
    small = entry.get("small", models[0])
    large = entry.get("large", models[1] if len(models) > 1 else None)
    for role, model in (("small", small), ("large", large)):
        if model not in models:
            raise ValueError(f"{where}: {role} model {model!r} is not one of the models {models}")
    known = {"policy", "small", "large", "threshold", "metric", "classifier", "seed"}
    if set(entry) - known:
        raise ValueError(f"{where}: unknown key(s) {sorted(set(entry) - known)}")
    threshold = entry.get("threshold", DEFAULT_THRESHOLDS.get(policy, 0.0))
    return RouteSpec(
        name,
        policy,
        small,
        large,
        float(threshold),
        entry.get("metric", "mean"),
        entry.get("classifier"),
        int(entry.get("seed", 0)),
    )


class Router:
    """One route over running engines: which model answers, and the cascade's two tries."""

    def __init__(
        self,
        spec: RouteSpec,
        engines: Mapping[str, AsyncLLMEngine],
        metrics: GatewayMetrics,
        classifier: RouteClassifier | None = None,
    ) -> None:
        self.spec = spec
        self.engines = engines
        self.metrics = metrics
        if spec.policy == "classifier" and classifier is None:
            classifier = RouteClassifier.load(spec.classifier or "")
        self.classifier = classifier
        self._rng = random.Random(spec.seed)

    def pick(self, query: str) -> str | None:
        """The model chosen before anything runs; None for the cascade (it tries small first)."""
        spec = self.spec
        if spec.policy == "random":
            return spec.large if self._rng.random() < spec.threshold else spec.small
        if spec.policy == "classifier":
            assert self.classifier is not None
            prob = float(self.classifier.prob_large([query])[0])
            return spec.large if prob >= spec.threshold else spec.small
        return None

    async def run(
        self,
        request_id: str,
        query: str,
        prompt_for: Callable[[str], PromptInput],
        params: SamplingParams,
    ) -> tuple[str, RequestStream | ReplayStream]:
        """(the model that answers, its stream)."""
        spec = self.spec
        name = self.pick(query)
        if name is None:
            small_params = params if params.logprobs is not None else replace(params, logprobs=0)
            small = await self.engines[spec.small].add_request(
                request_id, prompt_for(spec.small), small_params
            )
            output, steps = await record(small)
            if confidence(output, spec.metric) >= spec.threshold:
                self.metrics.route_requests.labels(spec.name, spec.small).inc()
                return spec.small, ReplayStream(output, steps, request_id)
            self.metrics.route_escalations.labels(spec.name).inc()
            name = spec.large
        stream = await self.engines[name].add_request(request_id, prompt_for(name), params)
        self.metrics.route_requests.labels(spec.name, name).inc()
        return name, stream


class RoutedRequest:
    """One request's view of a route, shaped like the AsyncLLMEngine the serving code calls:
    prompts are rendered for the small model (`engine`), and `translate` renders one for
    another model from the request itself (a chat's messages go through that model's own
    template). `on_answer` hears which model answered, before the first output is read."""

    def __init__(
        self,
        router: Router,
        query: str,
        translate: Callable[[str, PromptInput], PromptInput],
        on_answer: Callable[[str], None],
    ) -> None:
        self.router = router
        self.query = query
        self.translate = translate
        self.on_answer = on_answer
        self.answered_by: str | None = None
        self._taken = False

    @property
    def engine(self) -> LLMEngine:
        return self.router.engines[self.router.spec.small].engine

    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> RequestStream | ReplayStream:
        if self._taken:
            raise ValueError(f"a request to route {self.router.spec.name!r} takes one prompt")
        self._taken = True
        small = self.router.spec.small

        def prompt_for(name: str) -> PromptInput:
            return prompt if name == small else self.translate(name, prompt)

        name, stream = await self.router.run(request_id, self.query, prompt_for, params)
        self.answered_by = name
        self.on_answer(name)
        return stream
