"""Shared fixtures: the real packaged models, each loaded once per test session."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model
from tokenmill.sampling.params import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _collect_engines_after_each_module():
    """Engines and servers a module built can sit in reference cycles with their KV pools
    until the collector happens to run; collecting between modules keeps the suite's peak
    memory near what one module needs."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm(smollm_path: Path) -> LoadedModel:
    return load_model(str(smollm_path), torch.float32)


@pytest.fixture(scope="session")
def bf16_smollm(smollm_path: Path) -> LoadedModel:
    return load_model(str(smollm_path), torch.bfloat16)


@pytest.fixture(scope="session")
def quantized_smollm(smollm_path: Path) -> Callable[[str], LoadedModel]:
    """`quantized_smollm("int4")`: the default model loaded with that quantization."""
    cache: dict[str, LoadedModel] = {}

    def load(method: str) -> LoadedModel:
        if method not in cache:
            cache[method] = load_model(str(smollm_path), torch.float32, method)
        return cache[method]

    return load


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: Path):
    import transformers  # test-only dependency, never imported by tokenmill itself

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32
    )
    return model.eval()


class EngineRunner:
    """Engines on one loaded model, run to the end with every KV block accounted for."""

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
    """Engines on the real SmolLM2: `runner.engine(**engine_args)`, `runner.run(engine,
    prompts, params)`, `runner.chat(text)` for a one-turn chat prompt's ids."""
    return EngineRunner(smollm)


@pytest.fixture
def weather_tool() -> dict:
    """An OpenAI function tool with one bounded string argument, as chat requests carry it."""
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    }


@pytest.fixture(scope="session")
def long_text() -> str:
    """Real English prose that every CPython install carries: no download needed."""
    from pydoc_data.topics import topics

    return topics["class"] + topics["function"]


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    return load_model("gemma3-270m", torch.float32)


@pytest.fixture(scope="session")
def gemma_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Gemma 3 GGUF written out as a Hugging Face directory by `tokenmill export-hf`."""
    from tokenmill.loader.export import export_hf

    return export_hf("gemma3-270m", tmp_path_factory.mktemp("gemma3-hf"))


@pytest.fixture(scope="session")
def hf_gemma(gemma_hf_dir: Path):
    """transformers' own Gemma 3 over the exported weights: the numerical oracle."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_hf_dir), dtype=torch.float32
    )
    return model.eval()
