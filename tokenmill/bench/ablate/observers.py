"""Step observers the experiments hand to `run_throughput`: each records something about
every engine step from outside the engine."""

from __future__ import annotations

import time

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput


class FinishTimes:
    """A step observer: seconds since it was made at which each request finished."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seconds: list[float] = []

    def __call__(self, _: LLMEngine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic() - self.start
        self.seconds.extend(now for out in outputs if out.finished)


class SlotOccupancy:
    """A step observer: KV slots the running requests hold, and how many of them hold KV."""

    def __init__(self) -> None:
        self.reserved: list[int] = []
        self.used: list[int] = []

    def __call__(self, engine: LLMEngine, _: list[RequestOutput]) -> None:
        kv = engine.kv_manager
        assert kv is not None
        running = engine.scheduler.running
        if not running:
            return
        self.reserved.append(sum(kv.num_blocks_held(r.request_id) for r in running) * kv.block_size)
        self.used.append(sum(r.num_computed_tokens for r in running))


class FinishedTokens:
    """A step observer: each finished request's output token ids, keyed by its prompt (the
    workloads' prompts are distinct), so two engines' outputs can be compared."""

    def __init__(self) -> None:
        self.by_prompt: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, _: LLMEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.by_prompt[tuple(out.prompt_token_ids)] = list(out.outputs[0].token_ids)
