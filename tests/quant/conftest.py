"""The real SmolLM2 loaded once per quantization method for the whole session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill.loader.model_loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def quantized_smollm(smollm_path: Path) -> Callable[[str], LoadedModel]:
    """`quantized_smollm("int4")`: the default model loaded with that quantization."""
    cache: dict[str, LoadedModel] = {}

    def load(method: str) -> LoadedModel:
        if method not in cache:
            cache[method] = load_model(str(smollm_path), torch.float32, method)
        return cache[method]

    return load
