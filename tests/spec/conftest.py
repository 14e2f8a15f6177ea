"""Helpers for running the real SmolLM2 engine with and without speculation."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.sampling.params import SamplingParams

PASSAGE = (
    "The river Thames flows through southern England, passing through Oxford, Reading and "
    "London before it reaches the North Sea. It is about 346 kilometres long, and its tidal "
    "reach ends at Teddington Lock."
)


class EngineRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded

    def engine(self, **kwargs) -> LLMEngine:
        args = EngineArgs(model=str(self.loaded.path), **{"kv_cache_memory": "64MiB", **kwargs})
        return LLMEngine(args, loaded=self.loaded)

    def chat(self, content: str) -> list[int]:
        tokenizer = self.loaded.tokenizer
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], True)
        return tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def run(engine: LLMEngine, prompts, params: SamplingParams) -> list[RequestOutput]:
        ids = [f"req-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(request_id, prompt, params)
        done: dict[str, RequestOutput] = {}
        for _ in range(5000):
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
        assert not engine.has_unfinished_requests(), "engine stopped making progress"
        assert engine.kv_manager is not None
        assert engine.kv_manager.pool.num_free_blocks == engine.num_blocks, "KV blocks leaked"
        return [done[request_id] for request_id in ids]

    def tokens(self, prompts, params: SamplingParams, **kwargs) -> list[list[int]]:
        outputs = self.run(self.engine(**kwargs), prompts, params)
        return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="session")
def runner(smollm) -> EngineRunner:
    return EngineRunner(smollm)


@pytest.fixture(scope="session")
def rewrite_prompt(runner) -> list[int]:
    """An input-grounded task: the answer repeats the passage, so prompt lookup hits."""
    return runner.chat(f"Repeat this passage word for word:\n\n{PASSAGE}")
