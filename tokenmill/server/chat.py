"""POST /v1/chat/completions: the messages rendered with the model's chat template, `n` choices.

A stream opens each choice with a `{"role": "assistant", "content": ""}` delta, as OpenAI does,
then sends content deltas and a last delta carrying the finish reason. With tools, each choice's
text goes through a tool-call parser (structured/tool_parser.py) as it grows: content is sent as
content, and each call as OpenAI streams it, a first delta with its id, type and function name,
then fragments of its arguments as they are generated; a choice that made calls finishes with
"tool_calls".
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling.params import MAX_LOGPROBS
from tokenmill.server.errors import bad_request
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    ToolCall,
)
from tokenmill.server.serving import (
    SSE_DONE,
    Constraint,
    EngineStreamingResponse,
    Prompt,
    ServingContext,
    chat_prompt,
    check_fits,
    close_all,
    collect,
    compile_constraint,
    created_at,
    new_id,
    output_constraint,
    sampling_params,
    sse,
    sse_error,
    submit,
    usage,
)
from tokenmill.server.tools import (
    chat_template_input,
    plan_tools,
    tool_call_deltas,
    tool_reply,
)
from tokenmill.structured.tool_parser import ToolCallParser
from tokenmill.structured.tools import ToolPlan


@dataclass
class _Job:
    ctx: ServingContext
    req: ChatCompletionRequest
    prompt: Prompt
    logprobs: bool
    n: int
    tools: ToolPlan | None = None
    id: str = field(default_factory=lambda: new_id("chatcmpl"))
    created: int = field(default_factory=created_at)

    def chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.ctx.model_name, choices=choices
        )

    def reply(self, out: CompletionOutput) -> tuple[str | None, list[ToolCall] | None]:
        """A finished choice's content and calls (None unless the request has tools and the
        choice made calls; a choice cut off by max_tokens keeps its text)."""
        if self.tools is None or out.finish_reason != "stop":
            return out.text, None
        return tool_reply(self.tools, out.text)

    def logprobs_of(self, out: CompletionOutput, start: int) -> ChatLogprobs | None:
        if not self.logprobs or out.logprobs is None:
            return None
        return ChatLogprobs(content=chat_logprobs(self.ctx.tokenizer, out.logprobs[start:]))


async def create_chat_completion(
    req: ChatCompletionRequest, request: Request, ctx: ServingContext
) -> Response:
    ctx.check_model(req.model)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, param)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be >= 1, got {max_tokens}", param)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                "top_logprobs",
            )
    tools = plan_tools(req)
    rendered, template_tools = chat_template_input(req.messages, tools, ctx.tokenizer.chat_template)
    prompt = chat_prompt(ctx.tokenizer, req.messages, rendered, template_tools)
    top = (req.top_logprobs or 0) if req.logprobs else None
    constraint = output_constraint(req)
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise bad_request(
                f"tool_choice {tools.mode!r} cannot be combined with {constraint.param}",
                "tool_choice",
            )
        constraint = Constraint(tools.constraint, "tools")
    params = sampling_params(req, max_tokens=max_tokens, logprobs=top, constraint=constraint)
    check_fits(ctx, prompt, max_tokens, "messages")
    await compile_constraint(ctx, constraint)
    job = _Job(ctx, req, prompt, bool(req.logprobs), params.n, tools)
    streams = await submit(ctx, job.id, [prompt], params, "messages")
    if req.stream:
        return EngineStreamingResponse(_stream(job, streams[0]), streams)
    try:
        (output,) = await collect(streams, request)
    finally:
        close_all(streams)
    choices = []
    for out in output.outputs:
        content, calls = job.reply(out)
        message = AssistantMessage(content=content, tool_calls=calls)
        finish_reason = out.finish_reason if calls is None else "tool_calls"
        choices.append(
            ChatChoice(
                index=out.index,
                message=message,
                logprobs=job.logprobs_of(out, 0),
                finish_reason=finish_reason,
            )
        )
    num_tokens = sum(len(out.token_ids) for out in output.outputs)
    response = ChatCompletionResponse(
        id=job.id,
        created=job.created,
        model=ctx.model_name,
        choices=choices,
        usage=usage([prompt], num_tokens, [output]),
    )
    return JSONResponse(response.model_dump())


async def _stream(job: _Job, stream: RequestStream) -> AsyncIterator[str]:
    include_usage = job.req.include_usage
    exclude = None if include_usage else {"usage"}
    sent_chars = [0] * job.n
    sent_tokens = [0] * job.n
    num_tokens = 0
    last: list[RequestOutput] = []
    try:
        opening = [
            ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(job.n)
        ]
        yield sse(job.chunk(opening), exclude)
        parsers = None if job.tools is None else [job.tools.parser() for _ in range(job.n)]
        async for output in stream:
            for out in output.outputs:
                new_text = out.text[sent_chars[out.index] :]
                sent_chars[out.index] = len(out.text)
                if parsers is None:
                    delta = DeltaMessage(content=new_text) if new_text else DeltaMessage()
                    finish_reason = out.finish_reason
                else:
                    delta, finish_reason = _tool_delta(parsers[out.index], new_text, out)
                if delta == DeltaMessage() and out.finish_reason is None:
                    continue
                choice = ChatStreamChoice(
                    index=out.index,
                    delta=delta,
                    logprobs=job.logprobs_of(out, sent_tokens[out.index]),
                    finish_reason=finish_reason,
                )
                sent_tokens[out.index] = len(out.token_ids)
                yield sse(job.chunk([choice]), exclude)
            num_tokens = sum(len(out.token_ids) for out in output.outputs)
            last = [output]
        if include_usage:
            final = job.chunk([])
            final.usage = usage([job.prompt], num_tokens, last)
            yield sse(final)
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE


def _tool_delta(
    parser: ToolCallParser, new_text: str, out: CompletionOutput
) -> tuple[DeltaMessage, str | None]:
    """A choice's next delta with tools, and its finish reason once it has one: "tool_calls"
    when it ended by itself having made calls."""
    events = parser.feed(new_text)
    if out.finish_reason is not None:
        events.extend(parser.finish())
    delta = DeltaMessage(content=events.content or None, tool_calls=tool_call_deltas(events))
    finish_reason = out.finish_reason
    if finish_reason == "stop" and parser.calls:
        finish_reason = "tool_calls"
    return delta, finish_reason
