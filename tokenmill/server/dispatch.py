"""Which engine answers a request: the model its `model` field names (the first model when it
names none), a route in front of two models, and the semantic cache in front of either.

Each request gets its own ServingContext, whose engine may be a route's or the cache's view
of the engines; the endpoint code runs unchanged on it. The context's `model_name` becomes
the model that answered (a route's pick, a cached answer's author) as soon as that is known,
which is before the first byte of the response; headers say so too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from tokenmill.engine.async_engine import AsyncLLMEngine, RequestStream
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.gateway.cached_request import CachedRequest
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.routing import RoutedRequest, Router, RouteSpec
from tokenmill.gateway.semantic_cache import SemanticCache, normalise
from tokenmill.sampling.params import SamplingParams
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tokenmill.server.serving import (
    ClientDisconnectedError,
    ServingContext,
    chat_prompt,
    wait_for_disconnect,
)

MODEL_HEADER = "x-tokenmill-model"
CACHE_HEADER = "x-tokenmill-cache"
SYSTEM_ROLES = ("system", "developer")
TRANSPORT_FIELDS = {"model", "stream", "stream_options", "semantic_cache", "user"}
"""Request fields that do not shape the answer, left out of the cache's scope."""

Req = TypeVar("Req", bound=Any)
Handler = Callable[[Req, Request, ServingContext], Awaitable[Response]]


class Dispatcher:
    def __init__(
        self,
        engines: Mapping[str, AsyncLLMEngine],
        routes: Mapping[str, RouteSpec] | None = None,
        cache: SemanticCache | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.contexts = {name: ServingContext(engine, name) for name, engine in engines.items()}
        self.default = next(iter(engines))
        self.metrics = metrics or GatewayMetrics()
        self.routers = {
            name: Router(spec, engines, self.metrics) for name, spec in (routes or {}).items()
        }
        self.cache = cache
        if cache is not None:  # a cache read back from its file starts with entries
            self.metrics.cache_entries.set(len(cache))

    @property
    def names(self) -> list[str]:
        return [*self.contexts, *self.routers]

    def context(self, name: str | None) -> ServingContext:
        """The context of a named model; a route's is its small model's (for /tokenize)."""
        name = name or self.default
        if name in self.routers:
            name = self.routers[name].spec.small
        if name not in self.contexts:
            raise self.not_found(name)
        return self.contexts[name]

    def not_found(self, name: str) -> APIError:
        return APIError(
            404,
            f"The model `{name}` does not exist; this server serves "
            + ", ".join(f"`{n}`" for n in self.names),
            param="model",
            code="model_not_found",
        )

    async def serve(self, req: Req, request: Request, handler: Handler) -> Response:
        name = req.model or self.default
        if name not in self.contexts and name not in self.routers:
            raise self.not_found(name)
        req = req.model_copy(update={"model": None})  # resolved here, once
        ctx = ServingContext(self.contexts.get(name, self.context(name)).engine, name)
        tier: list[str] = []
        if name in self.routers or self.cache is not None:
            self._wrap(ctx, req, request, tier)
        response = await handler(req, request, ctx)
        response.headers[MODEL_HEADER] = ctx.model_name
        if tier:
            response.headers[CACHE_HEADER] = tier[0]
        return response

    def _wrap(self, ctx: ServingContext, req: Any, request: Request, tier: list[str]) -> None:
        """Put the route's view, then the cache's, in front of the context's engine."""
        name = ctx.model_name
        text = _RequestText.of(req)

        def answered_by(model: str) -> None:
            ctx.model_name = model

        if name in self.routers:
            if isinstance(req, CompletionRequest) and not isinstance(req.prompt, str):
                raise bad_request(f"a request to route `{name}` takes one text prompt", "prompt")
            routed = RoutedRequest(
                self.routers[name], text.query, self._translator(req), answered_by
            )
            ctx.engine = _UntilClientLeaves(routed, request)  # type: ignore[assignment]
        if self.cache is not None:

            def on_hit(hit_tier: str, model: str) -> None:
                tier.append(hit_tier)
                answered_by(model)

            ctx.engine = CachedRequest(  # type: ignore[assignment]
                self.cache,
                ctx.engine,
                {"model": name, **text.context},
                text.query_of,
                lambda: ctx.model_name,
                on_hit,
                self.metrics,
                getattr(req, "semantic_cache", None),
            )

    def _translator(self, req: Any) -> Callable[[str, PromptInput], PromptInput]:
        """A prompt for another model of a route, from the request: a chat rendered with that
        model's own template, a text prompt tokenized by its tokenizer."""

        def translate(model: str, prompt: PromptInput) -> PromptInput:
            tokenizer = self.contexts[model].tokenizer
            if isinstance(req, ChatCompletionRequest):
                rendered = chat_prompt(tokenizer, req.messages)
                return {"prompt": rendered.text, "prompt_token_ids": rendered.token_ids}
            assert isinstance(prompt, Mapping)
            return {
                "prompt": prompt["prompt"],
                "prompt_token_ids": tokenizer.encode(prompt["prompt"]),
            }

        return translate


class _UntilClientLeaves:
    """A route's view whose `add_request` is given up when the client disconnects. A cascade
    runs the small model's whole answer inside `add_request`, before the response (and its own
    disconnect watch) starts: giving it up there aborts the small model's pass, or the large
    model's admission, and frees their KV blocks."""

    def __init__(self, inner: RoutedRequest, request: Request) -> None:
        self.inner = inner
        self.request = request

    @property
    def engine(self) -> LLMEngine:
        return self.inner.engine

    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> RequestStream:
        work = asyncio.ensure_future(self.inner.add_request(request_id, prompt, params))
        gone = asyncio.ensure_future(wait_for_disconnect(self.request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # closes the small model's stream, or aborts an admission
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            raise ClientDisconnectedError
        return work.result()


class _RequestText:
    """What a request asks (the query the cache and the classifier read) and what frames it
    (the cache's scope: system prompt, earlier turns, every other field)."""

    def __init__(self, query: str | None, context: dict[str, Any]) -> None:
        self.query = query or ""
        self.context = context
        self._fixed = query is not None

    def query_of(self, prompt: PromptInput) -> str:
        """One prompt's query: the chat's last message, or the prompt's own text."""
        if self._fixed or not isinstance(prompt, Mapping):
            return self.query
        return str(prompt.get("prompt") or "")

    @classmethod
    def of(cls, req: Any) -> _RequestText:
        fields = req.model_dump(exclude=TRANSPORT_FIELDS | {"messages", "prompt"})
        if isinstance(req, ChatCompletionRequest):
            if not req.messages:  # the endpoint rejects it
                return cls("", {"endpoint": "chat"})
            system = [_text(m) for m in req.messages if m.role in SYSTEM_ROLES]
            turns = [m for m in req.messages if m.role not in SYSTEM_ROLES]
            history = [(m.role, normalise(_text(m))) for m in turns[:-1]]
            context = {"endpoint": "chat", "fields": fields, "system": system}
            last = turns[-1] if turns else req.messages[-1]
            return cls(_text(last), {**context, "history": history, "last_role": last.role})
        endpoint = "completions" if isinstance(req, CompletionRequest) else "generate"
        prompt = req.prompt if isinstance(req.prompt, str) else None
        return cls(prompt, {"endpoint": endpoint, "fields": fields})


def _text(message: ChatMessage) -> str:
    return str(message.as_template_message()["content"])
