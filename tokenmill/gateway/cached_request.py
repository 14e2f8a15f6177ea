"""One request's view of the semantic cache in front of an engine or a route, shaped like the
AsyncLLMEngine the serving code calls: a hit replays the cached answer, a miss runs the request
and caches its finished answer.

Only requests that allow it are looked up or stored: greedy ones (temperature 0), or sampled
ones that opt in; a request may opt out; prompt logprobs (which describe one exact prompt) are
never served from the cache.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict
from typing import Protocol

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.semantic_cache import CachedAnswer, SemanticCache
from tokenmill.gateway.streams import RecordingStream, ReplayStream
from tokenmill.sampling.params import SamplingParams

CACHEABLE_FINISH_REASONS = ("stop", "length")


class EngineLike(Protocol):
    @property
    def engine(self) -> LLMEngine: ...

    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> RequestStream | ReplayStream | RecordingStream: ...


def allows_cache(params: SamplingParams, opt_in: bool | None) -> bool:
    """`opt_in`: the request's own choice (None: greedy requests only)."""
    if opt_in is False or params.prompt_logprobs is not None:
        return False
    return opt_in is True or params.temperature == 0


def scope_of(context: dict, params: SamplingParams) -> str:
    """Everything besides the query that shapes an answer, as one string."""
    return json.dumps([context, asdict(params)], sort_keys=True, default=str)


class CachedRequest:
    def __init__(
        self,
        cache: SemanticCache,
        inner: EngineLike,
        context: dict,
        query_of: Callable[[PromptInput], str],
        answered_by: Callable[[], str],
        on_hit: Callable[[str, str], None],
        metrics: GatewayMetrics,
        opt_in: bool | None = None,
    ) -> None:
        """`context`: the scope's parts known before sampling (model, system prompt, earlier
        turns); `answered_by()`: who answered a miss; `on_hit(tier, model)`: told of a hit."""
        self.cache = cache
        self.inner = inner
        self.context = context
        self.query_of = query_of
        self.answered_by = answered_by
        self.on_hit = on_hit
        self.metrics = metrics
        self.opt_in = opt_in

    @property
    def engine(self) -> LLMEngine:
        return self.inner.engine

    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> RequestStream | ReplayStream | RecordingStream:
        if not allows_cache(params, self.opt_in):
            return await self.inner.add_request(request_id, prompt, params)
        scope, query = scope_of(self.context, params), self.query_of(prompt)
        start = time.perf_counter()
        found = self.cache.lookup(scope, query)
        self.metrics.cache_lookup.observe(time.perf_counter() - start)
        if found is not None:
            tier, answer = found
            self.metrics.cache_hits.labels(tier).inc()
            self.on_hit(tier, answer.model)
            return ReplayStream(answer.output, answer.steps, request_id)
        self.metrics.cache_misses.inc()
        stream = await self.inner.add_request(request_id, prompt, params)

        def keep(output: RequestOutput, steps: array) -> None:
            reasons = [c.finish_reason for c in output.outputs]
            if all(r in CACHEABLE_FINISH_REASONS for r in reasons):
                answer = CachedAnswer(output, self.answered_by(), steps)
                self.cache.insert(scope, query, answer)
                self.metrics.cache_entries.set(len(self.cache))

        if isinstance(stream, ReplayStream):  # a cascade's small answer, finished already
            keep(stream.final, stream.steps)
            return stream
        return RecordingStream(stream, keep)
