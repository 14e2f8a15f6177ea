"""One request's text as the engine produces it, and the chat prompt: what `generate` and
`chat` share."""

from __future__ import annotations

import time
from collections.abc import Iterator

from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams


def stream(
    engine: LLMEngine, prompt: PromptInput, params: SamplingParams
) -> Iterator[tuple[str, RequestOutput]]:
    """(new text, output so far) of one request as the engine produces them."""
    request_id = f"cli-{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, params)
    emitted = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                yield text[emitted:], output
                emitted = len(text)
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)


def chat_prompt(engine: LLMEngine, messages: list[dict[str, str]]) -> PromptInput:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return {
        "prompt": text,
        "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False),
    }
