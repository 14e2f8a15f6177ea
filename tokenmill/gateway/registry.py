"""The models one server runs: a name clients send, and the engine flags of that model.

They come from repeated `--model` flags (all sharing the command line's engine flags) or from a
config file naming each model with its own flags (tokenmill/gateway/serve_config.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

MiB = 2**20


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what a request's `model` field says
    args: EngineArgs


def specs_from_flags(
    models: Sequence[str], base: EngineArgs, served_model_name: str | None = None
) -> list[ModelSpec]:
    """One spec per `--model`, each with the command line's engine flags; a model is named by
    what was given (`--served-model-name` renames a single one)."""
    if not models:
        models = [base.model]
    if served_model_name is not None and len(models) > 1:
        raise ValueError("--served-model-name names one model; give a --config to name several")
    names = [served_model_name or models[0], *models[1:]]
    specs = [
        ModelSpec(name, replace(base, model=model))
        for name, model in zip(names, models, strict=True)
    ]
    check_unique([spec.name for spec in specs])
    return specs


def check_unique(names: Sequence[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"model name {name!r} is given twice; each model needs its own name")
        seen.add(name)


def build_engines(
    specs: Sequence[ModelSpec], report: Callable[[str], None] = logger.info
) -> dict[str, LLMEngine]:
    """Each model's engine, in the order given (the first is the default), reporting the
    memory of each as it is loaded."""
    engines = {}
    for spec in specs:
        engines[spec.name] = LLMEngine(spec.args)
        report(memory_report(spec.name, engines[spec.name]))
    return engines


def memory_report(name: str, engine: LLMEngine) -> str:
    weights, kv = weight_bytes(engine), engine.kv_cache_bytes
    return (
        f"model {name} ({engine.args.model}): weights {weights / MiB:.1f} MiB, "
        f"KV cache {kv / MiB:.1f} MiB, total {(weights + kv) / MiB:.1f} MiB"
    )


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied embeddings
    share one)."""
    storages: dict[int, int] = {}
    module = engine.loaded.model
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
