"""POST /v1/completions: one engine request per prompt, `n` choices each.

Choice `i * n + j` is completion j of prompt i. With `echo` the prompt comes first in the text
and, with `logprobs`, in the logprobs, its first token's logprob null: that is what lm-eval's
loglikelihood tasks read. `echo` with `max_tokens=0` runs the prompt for its logprobs and
returns no generated token (the engine samples one, which is dropped).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.server.errors import bad_request
from tokenmill.server.logprobs import extend_completion_logprobs
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tokenmill.server.serving import (
    SSE_DONE,
    EngineStreamingResponse,
    Prompt,
    ServingContext,
    check_fits,
    close_all,
    collect,
    compile_constraint,
    created_at,
    merge,
    new_id,
    output_constraint,
    sampling_params,
    sse,
    sse_error,
    submit,
    usage,
)


@dataclass
class ChoiceProgress:
    """How much of one choice a client has been sent."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False


@dataclass
class CompletionFormat:
    tokenizer: Tokenizer
    echo: bool
    echo_only: bool  # echo with max_tokens=0
    logprobs: bool

    def delta(
        self, sent: ChoiceProgress, prompt: Prompt, output: RequestOutput, out: CompletionOutput
    ) -> CompletionChoice | None:
        """What `out` adds to what was sent (all of it from a fresh ChoiceProgress); None when
        there is nothing new to show yet (text held back for a possible stop string)."""
        num_tokens = 0 if self.echo_only else len(out.token_ids)
        text = "" if self.echo_only else out.text
        finish_reason = out.finish_reason
        if self.echo_only and finish_reason is not None:
            finish_reason = "length"  # the token the engine sampled is not part of the answer
        new_text = text[sent.num_chars :]
        if sent.started and not new_text and finish_reason is None:
            return None
        logprobs = CompletionLogprobs() if self.logprobs else None
        piece = ""
        if not sent.started:
            sent.started = True
            if self.echo:
                piece = prompt.text
                if logprobs is not None:
                    sent.text_offset = extend_completion_logprobs(
                        logprobs,
                        self.tokenizer,
                        prompt.token_ids,
                        output.prompt_logprobs or [None] * len(prompt.token_ids),
                        sent.text_offset,
                    )
        if logprobs is not None and out.logprobs is not None:
            sent.text_offset = extend_completion_logprobs(
                logprobs,
                self.tokenizer,
                out.token_ids[sent.num_tokens : num_tokens],
                out.logprobs[sent.num_tokens : num_tokens],
                sent.text_offset,
            )
        sent.num_chars, sent.num_tokens = len(text), num_tokens
        return CompletionChoice(
            index=0, text=piece + new_text, logprobs=logprobs, finish_reason=finish_reason
        )

    def num_tokens(self, outputs: Sequence[RequestOutput]) -> int:
        if self.echo_only:
            return 0
        return sum(len(c.token_ids) for output in outputs for c in output.outputs)


@dataclass
class _Job:
    ctx: ServingContext
    req: CompletionRequest
    prompts: list[Prompt]
    fmt: CompletionFormat
    n: int
    id: str = field(default_factory=lambda: new_id("cmpl"))
    created: int = field(default_factory=created_at)

    def choices(
        self, index: int, output: RequestOutput, progress: dict[int, ChoiceProgress]
    ) -> Iterator[CompletionChoice]:
        for out in output.outputs:
            choice_index = index * self.n + out.index
            sent = progress.setdefault(choice_index, ChoiceProgress())
            choice = self.fmt.delta(sent, self.prompts[index], output, out)
            if choice is not None:
                choice.index = choice_index
                yield choice


async def create_completion(
    req: CompletionRequest, request: Request, ctx: ServingContext
) -> Response:
    ctx.check_model(req.model)
    echo = bool(req.echo)
    max_tokens = req.max_tokens
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        allowed = ">= 0 with echo" if echo else ">= 1 (0 only with echo)"
        raise bad_request(f"max_tokens must be {allowed}, got {max_tokens}", "max_tokens")
    echo_only = echo and max_tokens == 0
    prompts = _prompts(ctx.tokenizer, req.prompt)
    constraint = output_constraint(req)
    params = sampling_params(
        req,
        max_tokens=1 if echo_only else max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if echo else None,
        constraint=constraint,
    )
    for prompt in prompts:
        check_fits(ctx, prompt, params.max_tokens, "prompt")
    await compile_constraint(ctx, constraint)
    fmt = CompletionFormat(ctx.tokenizer, echo, echo_only, req.logprobs is not None)
    job = _Job(ctx, req, prompts, fmt, params.n)
    streams = await submit(ctx, job.id, prompts, params, "prompt")
    if req.stream:
        return EngineStreamingResponse(_stream(job, streams), streams)
    try:
        outputs = await collect(streams, request)
    finally:
        close_all(streams)
    progress: dict[int, ChoiceProgress] = {}
    choices = [c for i, output in enumerate(outputs) for c in job.choices(i, output, progress)]
    response = CompletionResponse(
        id=job.id,
        created=job.created,
        model=ctx.model_name,
        choices=sorted(choices, key=lambda c: c.index),
        usage=usage(prompts, fmt.num_tokens(outputs), outputs),
    )
    return JSONResponse(response.model_dump())


async def _stream(job: _Job, streams: list[RequestStream]) -> AsyncIterator[str]:
    include_usage = job.req.include_usage
    exclude = None if include_usage else {"usage"}
    finals: dict[int, RequestOutput] = {}
    progress: dict[int, ChoiceProgress] = {}
    try:
        async for index, output in merge(streams):
            for choice in job.choices(index, output, progress):
                chunk = CompletionChunk(
                    id=job.id, created=job.created, model=job.ctx.model_name, choices=[choice]
                )
                yield sse(chunk, exclude)
            if output.finished:
                finals[index] = output
        if include_usage:
            tokens = job.fmt.num_tokens(list(finals.values()))
            chunk = CompletionChunk(
                id=job.id,
                created=job.created,
                model=job.ctx.model_name,
                choices=[],
                usage=usage(job.prompts, tokens, list(finals.values())),
            )
            yield sse(chunk)
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE


def _prompts(
    tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[Prompt]:
    """Each prompt as text and token ids; a token-id prompt's text is its decoding."""
    if isinstance(prompt, str):
        return [Prompt(prompt, tokenizer.encode(prompt))]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [Prompt(p, tokenizer.encode(p)) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [_token_prompt(tokenizer, prompt)]
    return [_token_prompt(tokenizer, ids) for ids in prompt]


def _token_prompt(tokenizer: Tokenizer, token_ids: list[int]) -> Prompt:
    vocab = tokenizer.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    return Prompt(tokenizer.decode(token_ids, skip_special_tokens=False), list(token_ids))
