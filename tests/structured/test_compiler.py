"""Grammar compilation: once per distinct constraint, and a clear error for a bad one."""

from __future__ import annotations

import pytest

from tokenmill.sampling.structured_outputs import StructuredOutputsParams as Spec
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.vocab import tokenizer_info


@pytest.fixture(scope="module")
def compiler(smollm):
    compiler = GrammarCompiler(tokenizer_info(smollm.tokenizer, smollm.config.vocab_size))
    yield compiler
    compiler.shutdown()


def test_an_equal_constraint_reuses_the_compiled_grammar(compiler):
    first = compiler.compile(Spec(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    again = compiler.compile(Spec(json={"properties": {"a": {"type": "string"}}, "type": "object"}))
    assert first is again
    assert first.result(timeout=60) is not None


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (Spec(json="{not json"), "json"),
        (Spec(json="[1, 2]"), "json"),
        (Spec(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "json"),
        (Spec(regex="(ab"), "regex"),
        (Spec(grammar="root ::= undefined_rule"), "grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_its_field(
    compiler, spec, field
):
    with pytest.raises(ValueError, match=f"^{field}: the .* does not compile: ."):
        compiler.compile(spec).result(timeout=60)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}}}, "not"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
    ],
)
def test_a_schema_keyword_xgrammar_would_ignore_is_refused(compiler, schema, keyword):
    with pytest.raises(ValueError, match=f"^json: .*'{keyword}'.* is not supported"):
        compiler.compile(Spec(json=schema)).result(timeout=60)


def test_a_property_named_like_a_keyword_is_not_a_keyword(compiler):
    schema = {"type": "object", "properties": {"not": {"type": "string", "enum": ["if"]}}}
    assert compiler.compile(Spec(json=schema)).result(timeout=60) is not None
