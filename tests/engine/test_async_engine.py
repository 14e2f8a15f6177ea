"""AsyncLLMEngine on the real SmolLM2: the same tokens as the synchronous engine, aborts that free
blocks within a step, back-pressure, and a failing step that fails only the requests in flight."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import (
    AsyncLLMEngine,
    EngineBusyError,
    EngineStoppedError,
)
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colours are"]


def make_engine(loaded: LoadedModel, **kwargs) -> LLMEngine:
    args = EngineArgs(model=str(loaded.path), **{"kv_cache_memory": "64MiB", **kwargs})
    return LLMEngine(args, loaded=loaded)


async def last(stream) -> RequestOutput:
    outputs = [output async for output in stream]
    assert outputs and outputs[-1].finished
    return outputs[-1]


def run(engine: AsyncLLMEngine, body) -> object:
    """Run `body(engine)` with the engine loop started, then shut it down."""

    async def main():
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def blocks_in_use(engine: LLMEngine) -> int:
    assert engine.kv_manager is not None
    return engine.num_blocks - engine.kv_manager.pool.num_free_blocks


def test_concurrent_streams_give_the_tokens_of_the_synchronous_engine(smollm):
    expected = []
    sync = make_engine(smollm)
    for i, prompt in enumerate(PROMPTS):
        sync.add_request(str(i), prompt, GREEDY)
    while sync.has_unfinished_requests():
        expected += [out for out in sync.step() if out.finished]
    expected.sort(key=lambda out: int(out.request_id))

    async def body(engine: AsyncLLMEngine) -> list[RequestOutput]:
        streams = await asyncio.gather(
            *(engine.add_request(str(i), p, GREEDY) for i, p in enumerate(PROMPTS))
        )
        return await asyncio.gather(*(last(stream) for stream in streams))

    outputs = run(AsyncLLMEngine(make_engine(smollm)), body)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]


def test_outputs_are_cumulative_and_end_with_a_finished_one(smollm):
    async def body(engine: AsyncLLMEngine) -> list[RequestOutput]:
        stream = await engine.add_request("a", PROMPTS[0], GREEDY)
        return [output async for output in stream]

    outputs = run(AsyncLLMEngine(make_engine(smollm)), body)
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 9))
    assert [o.finished for o in outputs] == [False] * 7 + [True]


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(smollm):
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def body(engine: AsyncLLMEngine) -> tuple[int, int]:
        stream = await engine.add_request("a", PROMPTS[0], long)
        await anext(stream)
        held = blocks_in_use(engine.engine)
        stream.close()
        for _ in range(100):  # the abort lands before the loop's next step
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return held, engine.stats.kv_blocks_in_use

    async_engine = AsyncLLMEngine(make_engine(smollm))
    held, after = run(async_engine, body)
    assert held > 0 and after == 0
    assert blocks_in_use(async_engine.engine) == 0
    assert not async_engine.engine.has_unfinished_requests()


def test_an_engine_rejection_is_raised_to_its_caller_only(smollm):
    async def body(engine: AsyncLLMEngine) -> RequestOutput:
        with pytest.raises(ValueError, match="context length"):
            await engine.add_request("too-long", [100] * 9000, GREEDY)
        return await last(await engine.add_request("fine", PROMPTS[0], GREEDY))

    output = run(AsyncLLMEngine(make_engine(smollm)), body)
    assert len(output.outputs[0].token_ids) == 8


def test_requests_beyond_max_waiting_are_refused(smollm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body(engine: AsyncLLMEngine) -> None:
        running = await engine.add_request("running", PROMPTS[0], long)
        await anext(running)
        waiting = await engine.add_request("waiting", PROMPTS[1], long)
        with pytest.raises(EngineBusyError, match="max_waiting_requests=1"):
            await engine.add_request("refused", PROMPTS[2], long)
        running.close()
        waiting.close()

    async_engine = AsyncLLMEngine(make_engine(smollm, max_num_seqs=1), max_waiting_requests=1)
    run(async_engine, body)
    assert blocks_in_use(async_engine.engine) == 0


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(smollm):
    engine = make_engine(smollm)
    execute = engine.runner.execute
    calls = {"n": 0}

    def fail_once(scheduled):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return execute(scheduled)

    engine.runner.execute = fail_once

    async def body(async_engine: AsyncLLMEngine) -> RequestOutput:
        stream = await async_engine.add_request("doomed", PROMPTS[0], GREEDY)
        with pytest.raises(RuntimeError, match="injected"):
            await last(stream)
        assert blocks_in_use(engine) == 0
        return await last(await async_engine.add_request("next", PROMPTS[1], GREEDY))

    async_engine = AsyncLLMEngine(engine)
    output = run(async_engine, body)
    assert len(output.outputs[0].token_ids) == 8
    assert async_engine.metrics.finished.labels("error")._value.get() == 1


def test_shutdown_ends_streams_in_flight_and_refuses_new_requests(smollm):
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    engine = AsyncLLMEngine(make_engine(smollm))

    async def main() -> None:
        engine.start()
        stream = await engine.add_request("a", PROMPTS[0], long)
        await anext(stream)
        await engine.shutdown()
        with pytest.raises(EngineStoppedError):
            await last(stream)
        with pytest.raises(EngineStoppedError):
            await engine.add_request("b", PROMPTS[0], long)

    asyncio.run(main())
    assert blocks_in_use(engine.engine) == 0


def test_a_dynamic_batch_that_never_fills_still_runs_after_its_wait(smollm):
    engine = make_engine(smollm, scheduler="dynamic", max_num_seqs=8, max_wait_ms=100)
    steps = 0
    step = engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counting_step

    async def body(engine: AsyncLLMEngine) -> list[RequestOutput]:
        streams = [await engine.add_request(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*(last(stream) for stream in streams))

    outputs = run(AsyncLLMEngine(engine), body)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    # 100 ms of waiting polls about every millisecond, not flat out.
    assert steps < 300
