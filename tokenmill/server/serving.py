"""What the completions and chat endpoints share: checking a request against the model, turning
it into SamplingParams, handing its prompts to the engine, and gathering or streaming back.

A request's engine streams are closed however its response ends (finished, client gone, server
shutting down), which aborts whatever is still running and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import jinja2
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.engine.async_engine import (
    AsyncLLMEngine,
    EngineBusyError,
    EngineStoppedError,
    RequestStream,
)
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.server.errors import APIError, bad_request, internal_error, param_named_in
from tokenmill.server.protocol import (
    ChatMessage,
    ErrorResponse,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)

MAX_N = 16
"""Most completions one request may ask for per prompt."""

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")

RETRY_AFTER_S = 1
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    model_name: str

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt plus output) the engine will run."""
        return self.engine.engine.max_seq_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created_at() -> int:
    return int(time.time())


def chat_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    rendered: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    """The prompt of a conversation; `rendered`: the messages as the template is to see them,
    when that is not simply each message's own rendering; `tools`: for a template that renders
    them itself."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    if rendered is None:
        rendered = [m.as_template_message() for m in messages]
    try:
        text = tokenizer.apply_chat_template(rendered, tools=tools)
    except (ValueError, jinja2.TemplateError) as exc:
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from exc
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint and the request field it came from (for error bodies)."""

    spec: StructuredOutputsParams
    param: str


def output_constraint(req: SamplingFields) -> Constraint | None:
    """The constraint of OpenAI's `response_format` or vLLM's `structured_outputs` (not both);
    a malformed one is a 400 naming the field."""
    fmt, vllm = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and vllm is not None:
        raise bad_request(
            "set response_format or structured_outputs, not both", "structured_outputs"
        )
    if vllm is not None:
        try:
            spec = StructuredOutputsParams(
                json=vllm.json_schema,
                regex=vllm.regex,
                choice=vllm.choice,
                grammar=vllm.grammar,
                json_object=vllm.json_object,
            )
        except ValueError as exc:
            raise bad_request(f"structured_outputs: {exc}", "structured_outputs") from exc
        return Constraint(spec, "structured_outputs")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema", "response_format"
            )
        return Constraint(
            StructuredOutputsParams(json=fmt.json_schema.json_schema), "response_format"
        )
    known = ", ".join(RESPONSE_FORMAT_TYPES)
    raise bad_request(
        f"response_format.type must be one of {known}, got {fmt.type!r}", "response_format"
    )


async def compile_constraint(ctx: ServingContext, constraint: Constraint | None) -> None:
    """Wait, off the engine loop, until the constraint's grammar is compiled, so a request only
    reaches the engine with a grammar it can use; one that does not compile is a 400."""
    if constraint is None:
        return
    # The first constraint also builds the grammar compiler's vocabulary: not on the event loop.
    grammar = await asyncio.to_thread(ctx.engine.engine.structured.compile, constraint.spec)
    try:
        await asyncio.wrap_future(grammar)
    except ValueError as exc:
        raise bad_request(f"{constraint.param}: {exc}", constraint.param) from exc


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """SamplingParams for `req`; a value it rejects is a 400 naming the field."""
    n = 1 if req.n is None else req.n
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {n}", "n")
    given = {
        "n": n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "cache_ttl": _cache_ttl(req),
        "structured_outputs": None if constraint is None else constraint.spec,
    }
    try:  # a null field takes SamplingParams' default; null max_tokens means "to the context"
        return SamplingParams(
            max_tokens=max_tokens, **{k: v for k, v in given.items() if v is not None}
        )
    except ValueError as exc:
        raise bad_request(str(exc), param_named_in(str(exc), _SAMPLING_FIELDS, None)) from exc


def _cache_ttl(req: SamplingFields) -> float | None:
    ttl = None if req.cache is None else req.cache.ttl
    if ttl is not None and not 0 < ttl < float("inf"):
        raise bad_request(f"cache.ttl must be a number of seconds > 0, got {ttl}", "cache")
    return ttl


def check_fits(ctx: ServingContext, prompt: Prompt, max_tokens: int | None, param: str) -> None:
    """A prompt plus the tokens asked for must fit the context; both numbers in the message."""
    limit, num_prompt = ctx.max_model_len, len(prompt.token_ids)
    if num_prompt >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{num_prompt} tokens (at most {limit - 1} fit, leaving one to generate)",
            param,
        )
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but {num_prompt + max_tokens}"
            f" were requested ({num_prompt} in the prompt, {max_tokens} in max_tokens)",
            "max_tokens",
        )


async def submit(
    ctx: ServingContext,
    request_id: str,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    param: str,
) -> list[RequestStream]:
    """Hand every prompt to the engine at once; if one is refused, none stays running."""
    results = await asyncio.gather(
        *(
            ctx.engine.add_request(
                f"{request_id}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids}, params
            )
            for i, p in enumerate(prompts)
        ),
        return_exceptions=True,
    )
    streams = [r for r in results if isinstance(r, RequestStream)]
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is None:
        return streams
    close_all(streams)
    if isinstance(error, EngineBusyError):
        raise APIError(
            503,
            f"the server is busy: {error}; retry later",
            type="server_error",
            code="server_busy",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(error, EngineStoppedError):
        raise APIError(503, str(error), type="server_error", code="server_shutting_down")
    if isinstance(error, ValueError):
        raise bad_request(str(error), param)
    raise error


def close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams in the order they arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class ClientDisconnectedError(Exception):
    pass


async def collect(streams: Sequence[RequestStream], request: Request) -> list[RequestOutput]:
    """The final output of each stream; stops early (and the caller closes the streams) if the
    client goes away, so a non-streaming request is aborted as promptly as a streaming one."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def gather() -> None:
        async for index, output in merge(streams):
            finals[index] = output

    work = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientDisconnectedError
    work.result()
    return [output for output in finals if output is not None]


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (its request body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(
    prompts: Sequence[Prompt], completion_tokens: int, outputs: Sequence[RequestOutput] = ()
) -> Usage:
    """Token counts; `outputs` (one per prompt) tell how many prompt tokens were cached."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(output.num_cached_tokens for output in outputs)
        ),
    )


def sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    data = payload if isinstance(payload, dict) else payload.model_dump(exclude=exclude)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(exc: BaseException) -> str:
    info = exc.info if isinstance(exc, APIError) else internal_error(exc).info
    return sse(ErrorResponse(error=info))


SSE_DONE = "data: [DONE]\n\n"


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events whose engine requests are closed however the response ends, even if
    it ends before the first event (client gone at once, server shutting down)."""

    def __init__(self, content: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self._streams)
