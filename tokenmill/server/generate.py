"""The seeds' service endpoints beside the OpenAI ones: `POST /v1/generate`, one prompt in and its
text with its speed out (streamed as server-sent events on request), and `GET /v1/metrics`, a
JSON summary of the same series `/metrics` exposes to Prometheus."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import RequestModel
from tokenmill.server.serving import (
    SSE_DONE,
    EngineStreamingResponse,
    Prompt,
    ServingContext,
    check_fits,
    close_all,
    collect,
    new_id,
    sse,
    sse_error,
    submit,
)


class GenerateRequest(RequestModel):
    prompt: str
    max_tokens: int = 100
    temperature: float = 1.0
    stream: bool = False
    model: str | None = None


class GenerateResponse(BaseModel):
    text: str
    tokens_generated: int
    latency_ms: float  # from the server taking the request to its last token
    tokens_per_second: float  # tokens_generated over that latency
    finish_reason: str | None


async def create_generation(
    req: GenerateRequest, request: Request, ctx: ServingContext
) -> Response:
    ctx.check_model(req.model)
    if not req.prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
    try:
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature)
    except ValueError as exc:
        raise bad_request(str(exc), "temperature") from exc
    start = time.monotonic()
    prompt = Prompt(req.prompt, ctx.tokenizer.encode(req.prompt))
    check_fits(ctx, prompt, req.max_tokens, "prompt")
    streams = await submit(ctx, new_id("gen"), [prompt], params, "prompt")
    if req.stream:
        return EngineStreamingResponse(_stream(streams[0], start), streams)
    try:
        (output,) = await collect(streams, request)
    finally:
        close_all(streams)
    return JSONResponse(_result(output, start).model_dump())


def _result(output: RequestOutput, start: float) -> GenerateResponse:
    completion = output.outputs[0]
    latency_s = time.monotonic() - start
    num_tokens = len(completion.token_ids)
    return GenerateResponse(
        text=completion.text,
        tokens_generated=num_tokens,
        latency_ms=1000 * latency_s,
        tokens_per_second=num_tokens / latency_s if latency_s > 0 else 0.0,
        finish_reason=completion.finish_reason,
    )


async def _stream(stream: RequestStream, start: float) -> AsyncIterator[str]:
    """`{"text": piece}` events as text arrives, then the whole response's fields (its text
    included) in a last event, then `[DONE]`."""
    sent = 0
    try:
        async for output in stream:
            text = output.outputs[0].text
            if len(text) > sent:
                yield sse({"text": text[sent:]})
                sent = len(text)
            if output.finished:
                yield sse(_result(output, start))
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE
