"""StructuredOutputsParams: the constraint a request puts on its output, with vLLM's names.

Exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` (EBNF) or `json_object`
(any JSON object) is set. Only the shape of the fields is checked here; whether a schema, regex
or grammar compiles is the grammar compiler's to say (tokenmill/structured/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; got {named}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"json must be a JSON schema (str or dict), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise ValueError(f"choice must be a non-empty list of str, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must hold non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The one field that is set."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints, so compiled grammars are shared."""
        kind = self.kind
        if kind == "json":
            schema = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
            return kind, schema
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)
