"""Shared fixtures: the real packaged models, each loaded once per test session."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model


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
