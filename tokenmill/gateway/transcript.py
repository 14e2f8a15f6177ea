"""How a finished answer grew: after each engine step, for each choice, the tokens and the
characters shown so far and whether it had finished. With the final output this replays the
answer as the same sequence of cumulative outputs the engine streamed (a cache hit, a cascade's
small answer), so a replayed stream is chunked like a generated one.

Steps are kept flat in one int array (per step, per choice: tokens, characters, finished), a
few bytes a token, since the semantic cache holds one per entry.
"""

from __future__ import annotations

from array import array
from dataclasses import replace

from tokenmill.engine.outputs import CompletionOutput, RequestOutput

FIELDS_PER_CHOICE = 3


def steps_array(values: list[int] | None = None) -> array:
    return array("i", values or [])


class Recorder:
    """Notes the step of each output a stream yields (an unchanged one once)."""

    def __init__(self) -> None:
        self.steps = steps_array()
        self._last: list[int] | None = None

    def see(self, output: RequestOutput) -> None:
        step = [
            value
            for c in output.outputs
            for value in (len(c.token_ids), len(c.text), int(c.finish_reason is not None))
        ]
        if step != self._last:
            self.steps.extend(step)
            self._last = step


def replay(final: RequestOutput, steps: array, request_id: str) -> list[RequestOutput]:
    """The cumulative outputs of `steps`, cut from `final`, under `request_id`; the last is
    `final` itself (no steps: `final` alone)."""
    width = FIELDS_PER_CHOICE * len(final.outputs)
    starts = range(0, len(steps) - width, width)  # every step but the last
    outputs = [_cut(final, steps[start : start + width], request_id) for start in starts]
    return [*outputs, replace(final, request_id=request_id)]


def _cut(final: RequestOutput, step: array, request_id: str) -> RequestOutput:
    choices = [
        _cut_choice(choice, *step[i * FIELDS_PER_CHOICE : (i + 1) * FIELDS_PER_CHOICE])
        for i, choice in enumerate(final.outputs)
    ]
    return replace(final, request_id=request_id, outputs=choices, finished=False)


def _cut_choice(choice: CompletionOutput, tokens: int, chars: int, done: int) -> CompletionOutput:
    if done:
        return choice
    logprobs = None if choice.logprobs is None else choice.logprobs[:tokens]
    return CompletionOutput(
        index=choice.index,
        text=choice.text[:chars],
        token_ids=choice.token_ids[:tokens],
        cumulative_logprob=None if logprobs is None else sum(t.logprob for t in logprobs),
        logprobs=logprobs,
    )
