"""What the engine hands back each step, under vLLM's names so callers can switch engines."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.request import RequestMetrics
from tokenmill.sampling.sampler import TokenLogprobs
from tokenmill.structured.tools import ToolCall


@dataclass
class CompletionOutput:
    """One generated sequence so far (of `n` for the request), cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # `LLM.chat` with tools: the calls parsed from the finished text (then finish_reason is
    # "tool_calls"); None otherwise.
    tool_calls: list[ToolCall] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens whose KV was reused, not computed
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing
    # predicts it); entry i scores prompt token i given the tokens before it.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_disk_cached_tokens: int = 0  # the part of num_cached_tokens loaded from the disk tier
