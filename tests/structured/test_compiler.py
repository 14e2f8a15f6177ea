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
