"""Plain-text tables and JSON files: what a person reads at a glance and a script reads back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


def key_value_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns, one measurement a line."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-style pipe table padded to line up in a terminal, pasteable into docs as is."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Dataclasses anywhere in the payload are written as objects."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2, default=_as_json, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _as_json(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
