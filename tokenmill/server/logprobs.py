"""TokenLogprobs in OpenAI's two wire formats: the completions one (parallel lists, top
alternatives as a dict keyed by token text) and the chat one (a list of objects with bytes)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.sampling.sampler import TokenLogprobs
from tokenmill.server.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def extend_completion_logprobs(
    into: CompletionLogprobs,
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    text_offset: int,
) -> int:
    """Append one entry per token (None for a token nothing predicts, the first of an echoed
    prompt); the chosen token joins its top alternatives, as vLLM reports them, so a reader can
    tell whether it was the most likely one. Returns the text offset after the last token."""
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(tokenizer, token_id)
        into.tokens.append(text)
        into.text_offset.append(text_offset)
        text_offset += len(text)
        if entry is None:
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
            continue
        into.token_logprobs.append(entry.logprob)
        top = {token_text(tokenizer, t): logprob for t, logprob in entry.top}
        top.setdefault(text, entry.logprob)
        into.top_logprobs.append(top)
    return text_offset


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs]) -> list[ChatTokenLogprob]:
    return [
        ChatTokenLogprob(
            **_top(tokenizer, entry.token_id, entry.logprob).model_dump(),
            top_logprobs=[_top(tokenizer, t, logprob) for t, logprob in entry.top],
        )
        for entry in entries
    ]


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
