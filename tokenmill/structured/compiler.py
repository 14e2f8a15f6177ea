"""Compiling constraints into xgrammar grammars: once per distinct constraint, off the step loop.

`compile` returns a Future at once; one worker thread compiles (xgrammar's compiler uses its own
threads inside), and the future is kept, keyed by the constraint, so a schema many requests
share compiles once. A constraint xgrammar refuses fails its future with a ValueError that
names the field and xgrammar's reason.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock

import xgrammar as xgr

from tokenmill.sampling.structured_outputs import StructuredOutputsParams

# xgrammar prefixes its errors with a timestamp and a C++ source location.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    def __init__(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-grammar")
        self._futures: dict[tuple[str, str], Future[xgr.CompiledGrammar]] = {}
        self._lock = Lock()

    def compile(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, now or later; the same future for an equal spec."""
        with self._lock:
            future = self._futures.get(spec.key)
            if future is None:
                future = self._executor.submit(self._compile, spec)
                self._futures[spec.key] = future
            return future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                _check_schema(schema)
                return self._compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(_choice_grammar(spec.choice or ()))
            return self._compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _CPP_PREFIX.sub("", str(exc).strip()).splitlines()[0]
            raise ValueError(f"{kind}: the {_noun(kind)} does not compile: {reason}") from exc


UNHONOURED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
)
"""Keywords xgrammar accepts but does not enforce: a schema using one is refused, not loosened.
(`oneOf` is enforced as `anyOf`, which differs only when branches overlap.)"""

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _check_schema(schema: str) -> None:
    """A schema must be a JSON object whose every keyword xgrammar honours; xgrammar accepts
    some non-objects and some keywords without complaint."""
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(parsed).__name__}")
    _check_keywords(parsed, "#")


def _check_keywords(schema: object, path: str) -> None:
    """Walk the subschemas (not `const`, `enum` or property names, which are data)."""
    if not isinstance(schema, dict):
        return
    for keyword in UNHONOURED_KEYWORDS:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            raise ValueError(f"{keyword!r} (at {path}) is not supported")
    if len(schema.get("allOf") or ()) > 1:
        raise ValueError(f"'allOf' with more than one schema (at {path}) is not supported")
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check_keywords(sub, f"{path}/{key}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for index, sub in enumerate(value):
                _check_keywords(sub, f"{path}/{key}/{index}")
        elif key in ("items", "additionalProperties", "propertyNames", "unevaluatedProperties"):
            _check_keywords(value, f"{path}/{key}")


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF matching exactly one of `choices`."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _noun(kind: str) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice list"}.get(kind, "grammar")
