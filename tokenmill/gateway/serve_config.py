"""`tokenmill serve --config FILE`: the models (each with its own engine flags) and the routes
of one server, from TOML, JSON or YAML (YAML needs PyYAML installed).

    default = "smollm2-135m-instruct"          # optional: the first model otherwise
    [[models]]
    name = "smollm2-135m-instruct"             # what clients send as `model`
    model = "smollm2-135m-instruct"            # --model: a packaged name, .gguf or HF directory
    kv_cache_memory = "256MiB"                 # any engine flag, by its EngineArgs name
    [[models]]
    name = "gemma3-270m"
    [routes.auto]                              # clients send `"model": "auto"`
    policy = "cascade"                         # cascade | random | classifier
    small = "smollm2-135m-instruct"
    large = "gemma3-270m"
    threshold = -0.5

A model's flags start from the command line's and are overridden by its entry.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from tokenmill.config import EngineArgs
from tokenmill.gateway.registry import ModelSpec, check_unique
from tokenmill.gateway.routing import RouteSpec, route_spec

ENGINE_FIELDS = {f.name for f in fields(EngineArgs)}


@dataclass(frozen=True)
class ServeConfig:
    models: list[ModelSpec]  # the default first
    routes: dict[str, RouteSpec]


def read_serve_config(path: str | Path, base: EngineArgs) -> ServeConfig:
    data = _load(Path(path))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table with `models` (and optional `routes`)")
    unknown = set(data) - {"models", "routes", "default"}
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}; expected models, routes")
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: `models` must list at least one model")
    models = [_model_spec(entry, base, f"{path}: models[{i}]") for i, entry in enumerate(entries)]
    check_unique([m.name for m in models])
    default = data.get("default", models[0].name)
    names = [m.name for m in models]
    if default not in names:
        raise ValueError(f"{path}: default {default!r} is not one of the models {names}")
    models.sort(key=lambda m: m.name != default)
    routes = {
        name: route_spec(name, entry, names, f"{path}: routes.{name}")
        for name, entry in (data.get("routes") or {}).items()
    }
    clash = set(routes) & set(names)
    if clash:
        raise ValueError(f"{path}: route name(s) {sorted(clash)} are also model names")
    return ServeConfig(models, routes)


def _load(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix == ".json":
        return json.loads(text)
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise ValueError(f"--config {path}: YAML needs PyYAML; use .toml or .json") from exc
        return yaml.safe_load(text)
    raise ValueError(f"--config {path}: expected a .toml, .json, .yaml or .yml file")


def _model_spec(entry: Any, base: EngineArgs, where: str) -> ModelSpec:
    if isinstance(entry, str):
        entry = {"name": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ValueError(f"{where}: expected a table with a `name`")
    flags = {k.replace("-", "_"): v for k, v in entry.items() if k != "name"}
    unknown = set(flags) - ENGINE_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown engine flag(s) {sorted(unknown)}")
    flags.setdefault("model", entry["name"])
    return ModelSpec(entry["name"], replace(base, **flags))
