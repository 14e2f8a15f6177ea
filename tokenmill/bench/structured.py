"""What structured outputs cost a throughput run: the JSON schema every request is held to, its
compile time cold and cached, and the per-step time of the token masks and matchers (the mask
fill's own time, and what the step loop spent on masks: with the fill overlapping the forward
pass, only the wait for it and the apply)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.structured.manager import StructuredStats

FIVE_FIELDS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 48},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "member", "tags"],
}
"""The built-in schema (`--json-schema five_fields`): five fields of the common JSON types."""

BUILTIN_SCHEMAS = {"five_fields": FIVE_FIELDS}


def schema_variants(count: int, seed: int) -> list[dict]:
    """`count` distinct copies of the built-in schema, its field names marked with the seed and
    the copy's number: a server compiles each apart (its grammar cache cannot serve one for
    another), and another seed makes a warm server compile again."""
    variants = []
    for number in range(count):
        suffix = f"_{seed}_{number}"
        properties = {f"{name}{suffix}": field for name, field in FIVE_FIELDS["properties"].items()}
        required = [f"{name}{suffix}" for name in FIVE_FIELDS["required"]]
        variants.append({**FIVE_FIELDS, "properties": properties, "required": required})
    return variants


def load_json_schema(name: str) -> StructuredOutputsParams:
    """A built-in schema by name, or a JSON schema file."""
    if name in BUILTIN_SCHEMAS:
        return StructuredOutputsParams(json=BUILTIN_SCHEMAS[name])
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"json_schema must be one of {', '.join(BUILTIN_SCHEMAS)} or a JSON schema file; "
            f"{path} does not exist"
        )
    return StructuredOutputsParams(json=path.read_text(encoding="utf-8"))


@dataclass
class CompileTimes:
    vocab_build_s: float  # the compiler's vocabulary, built on an engine's first constraint
    compile_cold_s: float  # the schema's first compile
    compile_cached_s: float  # the same schema again: the engine's cache of compiled grammars


def measure_compile(engine: LLMEngine, spec: StructuredOutputsParams) -> CompileTimes:
    """Compile `spec` on `engine` twice (it must not have seen it), timing each part."""
    start = time.perf_counter()
    grammar = engine.structured.compile(spec)
    submitted = time.perf_counter()
    grammar.result()
    compiled = time.perf_counter()
    engine.structured.compile(spec).result()
    return CompileTimes(submitted - start, compiled - submitted, time.perf_counter() - compiled)


@dataclass
class StructuredCost:
    schema: str
    compile: CompileTimes
    num_masked_steps: int
    mask_ms_per_step: float  # the step loop's time on the masks: fill (or wait for it) + apply
    fill_ms_per_step: float  # filling the constrained rows' bitmask, wherever it ran
    matcher_ms_per_step: float  # advancing the matchers over the accepted tokens
    share_of_elapsed: float  # the step loop's mask and matcher time, over the run's wall time

    @classmethod
    def of(
        cls,
        schema: str,
        compile_times: CompileTimes,
        before: StructuredStats,
        after: StructuredStats,
        elapsed_s: float,
    ) -> StructuredCost:
        steps = after.num_masked_steps - before.num_masked_steps
        mask_s = after.mask_time_s - before.mask_time_s
        fill_s = after.fill_time_s - before.fill_time_s
        accept_s = after.accept_time_s - before.accept_time_s
        return cls(
            schema=schema,
            compile=compile_times,
            num_masked_steps=steps,
            mask_ms_per_step=1000 * mask_s / steps if steps else 0.0,
            fill_ms_per_step=1000 * fill_s / steps if steps else 0.0,
            matcher_ms_per_step=1000 * accept_s / steps if steps else 0.0,
            share_of_elapsed=(mask_s + accept_s) / elapsed_s if elapsed_s else 0.0,
        )

    def rows(self) -> list[tuple[str, str]]:
        c = self.compile
        return [
            ("json schema", self.schema),
            ("vocab build (first constraint)", f"{1000 * c.vocab_build_s:.1f} ms"),
            (
                "schema compile cold / cached",
                f"{1000 * c.compile_cold_s:.2f} ms / {1000 * c.compile_cached_s:.3f} ms",
            ),
            ("masked steps", f"{self.num_masked_steps}"),
            ("mask fill per step (its own time)", f"{self.fill_ms_per_step:.3f} ms"),
            ("mask per step (step loop's time)", f"{self.mask_ms_per_step:.3f} ms"),
            ("matcher advance per step", f"{self.matcher_ms_per_step:.3f} ms"),
            ("mask + matcher share of elapsed", f"{self.share_of_elapsed:.1%}"),
        ]


def snapshot(engine: LLMEngine) -> StructuredStats:
    """The engine's structured-output counters now, to subtract from a later snapshot."""
    return dataclasses.replace(engine.structured.stats)
