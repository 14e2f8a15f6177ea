"""How a finished answer grew: after each engine step, for each choice, the tokens and the
characters shown so far and whether it had finished. With the final output this replays the
answer as the same sequence of cumulative outputs the engine streamed (a cache hit, a cascade's
small answer), so a replayed stream is chunked like a generated one."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.engine.outputs import CompletionOutput, RequestOutput

Step = tuple[tuple[int, int, bool], ...]
"""Per choice: (tokens, characters, finished)."""


def step_of(output: RequestOutput) -> Step:
    return tuple(
        (len(c.token_ids), len(c.text), c.finish_reason is not None) for c in output.outputs
    )


class Recorder:
    """Notes the step of each output a stream yields (an unchanged one once)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def see(self, output: RequestOutput) -> None:
        step = step_of(output)
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)


def replay(final: RequestOutput, steps: tuple[Step, ...], request_id: str) -> list[RequestOutput]:
    """The cumulative outputs of `steps`, cut from `final`, under `request_id`; the last is
    `final` itself (no steps: `final` alone)."""
    outputs = [_cut(final, step, request_id) for step in steps[:-1]]
    return [*outputs, replace(final, request_id=request_id)]


def _cut(final: RequestOutput, step: Step, request_id: str) -> RequestOutput:
    choices = [
        _cut_choice(choice, tokens, chars, done)
        for choice, (tokens, chars, done) in zip(final.outputs, step, strict=True)
    ]
    return replace(final, request_id=request_id, outputs=choices, finished=False)


def _cut_choice(choice: CompletionOutput, tokens: int, chars: int, done: bool) -> CompletionOutput:
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
