"""The offline API: LLM.generate and LLM.chat on the real model."""

from __future__ import annotations

import json
import re

import pytest

from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(smollm) -> LLM:
    return LLM(model=str(smollm.path), kv_cache_memory="128MiB")


def test_generate_accepts_strings_token_ids_and_per_prompt_params(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    params = [
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=2),
    ]
    outputs = llm.generate(
        ["The capital of France is", {"prompt_token_ids": ids}, ids], params, use_tqdm=False
    )
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert outputs[2].outputs[0].token_ids == outputs[0].outputs[0].token_ids[:2]
    assert outputs[0].outputs[0].text.startswith(" Paris")
    assert outputs[0].prompt_token_ids == ids


def test_generate_returns_outputs_in_prompt_order(llm):
    prompts = ["One", "Two two", "Three three three"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [out.prompt for out in outputs] == prompts


def test_chat_uses_the_template_and_stops_at_end_of_turn(llm):
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    (output,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"
    assert output.metrics.first_token_time is not None


def test_a_bad_prompt_in_a_batch_adds_none_of_it(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["fine", {"prompt_token_ids": [-1]}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_generate_refuses_a_constraint_that_does_not_compile(llm):
    spec = StructuredOutputsParams(json='{"type": "object", "properties": 3')
    with pytest.raises(ValueError, match="^json"):
        llm.generate("Hi", SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_generate_follows_a_regex(llm):
    spec = StructuredOutputsParams(regex=r"[0-9]{2} (apples|pears)")
    (output,) = llm.generate(
        "Tell me a fact:", SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False
    )
    assert re.fullmatch(r"[0-9]{2} (apples|pears)", output.outputs[0].text)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_chat_with_a_required_tool_returns_parsed_calls(llm, weather_tool):
    params = SamplingParams(temperature=0, max_tokens=40)
    (output,) = llm.chat(ASK, params, use_tqdm=False, tools=[weather_tool], tool_choice="required")
    (completion,) = output.outputs
    assert completion.finish_reason == "tool_calls"
    call = completion.tool_calls[0]
    assert call.name == "get_weather" and call.id
    assert isinstance(json.loads(call.arguments)["city"], str)


def test_chat_accepts_a_tool_result_turn(llm, weather_tool):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    ]
    params = SamplingParams(temperature=0, max_tokens=8)
    (output,) = llm.chat(conversation, params, use_tqdm=False, tools=[weather_tool])
    assert output.outputs[0].text


def test_chat_refuses_a_tool_choice_naming_no_tool(llm, weather_tool):
    named = {"type": "function", "function": {"name": "get_news"}}
    with pytest.raises(ValueError, match="get_news"):
        llm.chat(ASK, use_tqdm=False, tools=[weather_tool], tool_choice=named)
    assert not llm.engine.has_unfinished_requests()
