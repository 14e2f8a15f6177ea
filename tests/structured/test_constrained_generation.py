"""Constrained generation on the real SmolLM2: outputs obey their constraint however they are
sampled, scheduled or speculated, and every KV block comes back."""

from __future__ import annotations

import json
import re
import threading

import pydantic
import pytest

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population: int = pydantic.Field(ge=0, le=100_000_000)


CITY = StructuredOutputsParams(json=City.model_json_schema())
TEAM = StructuredOutputsParams(
    json={
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10}},
            "required": ["name"],
        },
        "minItems": 3,
        "maxItems": 3,
    }
)
PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def engine(runner) -> LLMEngine:
    return runner.engine()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(runner, engine, temperature):
    prompts = [runner.chat(f"Describe {city} as JSON.") for city in ("Paris", "Lagos", "Lima")]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=64, structured_outputs=CITY)
    for output in runner.run(engine, prompts, params):
        (completion,) = output.outputs
        assert completion.finish_reason == "stop"
        City.model_validate_json(completion.text)


def test_regex_holds_for_every_sample(runner, engine):
    params = SamplingParams(
        n=8,
        temperature=1.0,
        seed=5,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(regex=PHONE),
    )
    (output,) = runner.run(engine, [runner.chat("Make up a phone number.")], params)
    assert len(output.outputs) == 8
    for completion in output.outputs:
        assert re.fullmatch(PHONE, completion.text), completion.text


def test_choice_holds_for_every_sample(runner, engine):
    choices = ["red", "green", "blue"]
    params = SamplingParams(
        n=8,
        temperature=1.0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    (output,) = runner.run(engine, [runner.chat("Pick a colour.")], params)
    assert {completion.text for completion in output.outputs} <= set(choices)


def test_a_completed_grammar_ends_the_request_even_ignoring_eos(runner, engine):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, structured_outputs=spec)
    (output,) = runner.run(engine, [runner.chat("Is water wet?")], params)
    (completion,) = output.outputs
    assert completion.text in ("yes", "no")
    assert completion.finish_reason == "stop"
    assert len(completion.token_ids) < 16


@pytest.mark.parametrize(
    "speculation",
    [
        {"speculative_method": "ngram"},
        {"speculative_method": "draft", "draft_model": "self:layers=8"},
    ],
    ids=["ngram", "draft"],
)
def test_greedy_output_is_the_same_with_speculative_decoding(runner, engine, speculation):
    prompts = [runner.chat("List three team members as JSON."), runner.chat("Describe Oslo.")]
    team = SamplingParams(temperature=0, max_tokens=48, structured_outputs=TEAM)
    plain = [out.outputs[0].token_ids for out in runner.run(engine, prompts, team)]
    speculative = runner.engine(**speculation)
    outputs = runner.run(speculative, prompts, team)
    assert [out.outputs[0].token_ids for out in outputs] == plain
    assert speculative.scheduler.stats.num_verify_steps > 0
    json.loads(outputs[0].outputs[0].text)


def test_greedy_output_is_the_same_across_preemption(runner, engine):
    prompts = [runner.chat(f"Describe {city} as JSON.") for city in ("Rome", "Cairo", "Quito")]
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=CITY)
    expected = [out.outputs[0].token_ids for out in runner.run(engine, prompts, params)]
    small = runner.engine(kv_cache_memory=5 * 16 * engine.kv_bytes_per_token)
    outputs = runner.run(small, prompts, params)
    assert small.scheduler.stats.num_preemptions > 0
    assert [out.outputs[0].token_ids for out in outputs] == expected


def test_greedy_output_is_the_same_with_the_masks_filled_after_the_forward_pass(runner, engine):
    prompts = [runner.chat(f"Describe {city} as JSON.") for city in ("Kyiv", "Perth")]
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=CITY)
    overlapped = [out.outputs[0].token_ids for out in runner.run(engine, prompts, params)]
    in_loop = runner.engine(overlap_grammar_masks=False)
    assert [out.outputs[0].token_ids for out in runner.run(in_loop, prompts, params)] == overlapped
    assert in_loop.structured.stats.num_masked_steps > 0


def test_a_constraint_that_does_not_compile_is_refused_without_holding_blocks(engine):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="^regex"):
        engine.structured.compile(bad.structured_outputs).result(timeout=60)
    with pytest.raises(ValueError, match="^regex"):
        engine.add_request("bad", "Hello", bad)
    assert not engine.has_unfinished_requests()


def test_a_compiling_grammar_does_not_hold_back_other_requests(runner, engine, monkeypatch):
    """The compiler is held on an event until the unconstrained request has finished."""
    engine.structured.compile(StructuredOutputsParams(json_object=True)).result(timeout=60)
    compiler = engine.structured._compiler
    compile_now = threading.Event()
    compile_spec = compiler._compile

    def held_compile(spec):
        compile_now.wait(timeout=120)
        return compile_spec(spec)

    monkeypatch.setattr(compiler, "_compile", held_compile)
    year = StructuredOutputsParams(regex=r"(19|20)[0-9]{2}")
    engine.add_request(
        "held", runner.chat("A year?"), SamplingParams(max_tokens=8, structured_outputs=year)
    )
    engine.add_request(
        "free", runner.chat("Say hi."), SamplingParams(max_tokens=8, ignore_eos=True)
    )
    seen: dict[str, RequestOutput] = {}
    try:
        for _ in range(100):
            seen |= {output.request_id: output for output in engine.step()}
            if "free" in seen and seen["free"].finished:
                break
        assert seen["free"].finished and len(seen["free"].outputs[0].token_ids) == 8
        assert "held" not in seen
    finally:
        compile_now.set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        seen |= {output.request_id: output for output in engine.step()}
    assert seen["held"].finished
    assert re.fullmatch(r"(19|20)[0-9]{2}", seen["held"].outputs[0].text)
    assert engine.kv_manager.pool.num_free_blocks == engine.num_blocks
