"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLMEngine per model, run by
uvicorn.

`build_app` wires routes, errors and auth around the engines (tests build several in one
process around one loaded model), and the web playground at `/` unless told not to; which
engine answers a request is the Dispatcher's call (server/dispatch.py). `run_server` is what
`tokenmill serve` calls.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.engine import LLMEngine
from tokenmill.gateway.metrics import model_labelled_registry
from tokenmill.gateway.registry import ModelSpec, build_engines
from tokenmill.gateway.routing import RouteSpec
from tokenmill.gateway.semantic_cache import SemanticCache
from tokenmill.loader.chat_template import DEFAULT_CHAT_TEMPLATE
from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.dispatch import Dispatcher
from tokenmill.server.errors import APIError, bad_request, internal_error, validation_error
from tokenmill.server.generate import GenerateRequest, create_generation
from tokenmill.server.playground import playground_routes
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from tokenmill.server.serving import (
    ClientDisconnectedError,
    chat_prompt,
    created_at,
)

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first"; nobody reads it


def build_app(
    engine: LLMEngine | Mapping[str, LLMEngine],
    model_name: str | None = None,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    ui: bool = True,
    routes: Mapping[str, RouteSpec] | None = None,
    semantic_cache: SemanticCache | None = None,
) -> FastAPI:
    """`engine`: one engine named `model_name`, or engines by name, the default first."""
    engines = engine if isinstance(engine, Mapping) else {model_name or engine.args.model: engine}
    async_engines = {name: AsyncLLMEngine(e, max_waiting_requests) for name, e in engines.items()}

    def close() -> None:
        for e in engines.values():
            e.close()  # the disk tier, if any, writes the cached blocks it lacks

    return build_app_over(async_engines, api_key, ui, routes, semantic_cache, close)


def build_app_over(
    async_engines: Mapping[str, AsyncLLMEngine],
    api_key: str | None = None,
    ui: bool = True,
    routes: Mapping[str, RouteSpec] | None = None,
    semantic_cache: SemanticCache | None = None,
    on_close: Callable[[], None] = lambda: None,
) -> FastAPI:
    """The app over engines shaped like AsyncLLMEngine (local ones, or replicas elsewhere that
    tokenmill.cluster puts behind that shape): started with the app, shut down with it."""
    dispatcher = Dispatcher(async_engines, routes, semantic_cache)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for async_engine in async_engines.values():
            async_engine.start()
        try:
            yield
        finally:
            for async_engine in async_engines.values():
                await async_engine.shutdown()
            on_close()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.serving = dispatcher.context(None)
    app.state.dispatcher = dispatcher
    _add_error_handlers(app)
    app.include_router(_open_routes(dispatcher))
    if ui:
        app.include_router(playground_routes())
    auth = [Depends(_bearer_check(api_key))] if api_key else []
    app.include_router(_api_routes(dispatcher), dependencies=auth)
    return app


def run_server(
    models: Sequence[ModelSpec] | EngineArgs,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    max_waiting_requests: int | None,
    shutdown_timeout_s: float,
    ui: bool = True,
    routes: Mapping[str, RouteSpec] | None = None,
    semantic_cache: SemanticCache | None = None,
) -> int:
    if isinstance(models, EngineArgs):
        models = [ModelSpec(served_model_name or models.model, models)]
    engines = build_engines(models, report=lambda line: print(f"tokenmill: {line}", flush=True))
    app = build_app(
        engines,
        api_key=api_key,
        max_waiting_requests=max_waiting_requests,
        ui=ui,
        routes=routes,
        semantic_cache=semantic_cache,
    )
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout_s)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again with the handler
    # it found installed; a no-op handler makes that second delivery a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(config).run()
    return 0


class _FailAloneRoute(APIRoute):
    """An unexpected exception becomes this request's 500 with an OpenAI-style body. (Left to
    Starlette, it would be re-raised to uvicorn, which drops the connection instead.)"""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, HTTPException, RequestValidationError, ClientDisconnectedError):
                raise
            except Exception as exc:
                logger.error("request to %s failed", request.url.path, exc_info=exc)
                return internal_error(exc).response()

        return handle


def _open_routes(dispatcher: Dispatcher) -> APIRouter:
    router = APIRouter()
    contexts = dispatcher.contexts.values()

    @router.get("/health")
    async def health() -> Response:
        """200 while every engine loop runs; 503 once one stopped."""
        running = all(ctx.engine.is_running for ctx in contexts)
        return Response(status_code=200 if running else 503)

    return router


def _api_routes(dispatcher: Dispatcher) -> APIRouter:
    router = APIRouter(route_class=_FailAloneRoute)
    ctx = dispatcher.context(None)
    metrics_registries = _metrics_registries(dispatcher)

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await dispatcher.serve(req, request, create_completion)

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await dispatcher.serve(req, request, create_chat_completion)

    @router.post("/v1/generate")
    async def generate(req: GenerateRequest, request: Request) -> Response:
        """The seeds' endpoint: one prompt, its text, tokens, latency and rate."""
        return await dispatcher.serve(req, request, create_generation)

    @router.get("/v1/metrics")
    async def metrics_summary() -> dict[str, Any]:
        """The seeds' JSON summary of the counters behind /metrics (the default model's; with
        several models, each one's under `models` too)."""
        summary = ctx.engine.metrics.summary()
        if len(dispatcher.contexts) > 1:
            summary["models"] = {
                name: c.engine.metrics.summary() for name, c in dispatcher.contexts.items()
            }
        return summary

    @router.get("/v1/models")
    async def models() -> ModelList:
        created = created_at()
        return ModelList(
            data=[
                ModelCard(
                    id=name, created=created, max_model_len=dispatcher.context(name).max_model_len
                )
                for name in dispatcher.names
            ]
        )

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        ctx = dispatcher.context(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tokens = chat_prompt(ctx.tokenizer, req.messages).token_ids
        else:
            tokens = ctx.tokenizer.encode(req.prompt or "", req.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens)

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> TokenizerInfo:
        """What lm-eval's remote tokenizer reads, so it needs no tokenizer download (the
        default model's)."""
        tokenizer = ctx.tokenizer

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.id_to_token(token_id)

        return TokenizerInfo(
            eos_token=text(tokenizer.eos_token_id),
            bos_token=text(tokenizer.bos_token_id),
            chat_template=tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE,
            model_max_length=ctx.max_model_len,
        )

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx = dispatcher.context(req.model)
        vocab = ctx.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))

    @router.get("/metrics")
    async def metrics() -> Response:
        body = b"".join(generate_latest(r) for r in metrics_registries)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router


def _metrics_registries(dispatcher: Dispatcher) -> list[CollectorRegistry]:
    """One model's series as they are; several models' each labelled with its `model`; the
    gateway's when it routes or caches."""
    contexts = dispatcher.contexts
    if len(contexts) == 1:
        registries = [dispatcher.context(None).engine.metrics.registry]
    else:
        registries = [
            model_labelled_registry({n: c.engine.metrics.registry for n, c in contexts.items()})
        ]
    if dispatcher.routers or dispatcher.cache is not None:
        registries.append(dispatcher.metrics.registry)
    return registries


def _bearer_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    """Compare digests of the header and the expected value, so neither the key's content nor
    its length shows in the time a wrong guess takes."""
    expected = hashlib.sha256(f"Bearer {api_key}".encode()).digest()

    async def check(request: Request) -> None:
        given = hashlib.sha256(request.headers.get("authorization", "").encode()).digest()
        if not hmac.compare_digest(given, expected):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(ClientDisconnectedError)
    async def client_gone(_: Request, __: ClientDisconnectedError) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
