"""Tool calling on /v1/chat/completions through the official openai client."""

from __future__ import annotations

import json

import openai
import pytest

MODEL = "smollm2-135m-instruct"
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture
def ask(client, weather_tool):
    def ask(**kwargs):
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[weather_tool, TIME],
            temperature=0,
            max_tokens=40,
            **kwargs,
        )

    return ask


def test_required_tool_choice_returns_a_valid_call_with_string_arguments(ask):
    (choice,) = ask(tool_choice="required").choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(call.function.arguments, str)
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 20


def test_named_tool_choice_calls_that_function(ask):
    named = {"type": "function", "function": {"name": "get_weather"}}
    (choice,) = ask(tool_choice=named).choices
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_streamed_tool_calls_arrive_in_pieces_and_reassemble_to_the_same_call(ask):
    (whole,) = ask(tool_choice="required").choices
    deltas: dict[int, list] = {}
    finish_reason = None
    for chunk in ask(tool_choice="required", stream=True):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                deltas.setdefault(delta.index, []).append(delta)
    assert finish_reason == "tool_calls"
    for pieces in deltas.values():
        first, *rest = pieces
        assert first.id and first.type == "function" and first.function.name
        assert rest and all(p.id is None and p.function.name is None for p in rest)
    assert [
        {
            "name": deltas[i][0].function.name,
            "arguments": "".join(p.function.arguments or "" for p in deltas[i]),
        }
        for i in sorted(deltas)
    ] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]


def test_a_second_turn_with_the_tool_result_is_accepted(client, ask, weather_tool):
    (first,) = ask(tool_choice="required").choices
    call = first.message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[weather_tool], tool_choice="none", max_tokens=8
    )
    assert response.choices[0].message.content is not None


def test_an_unknown_function_in_tool_choice_is_a_400(ask):
    with pytest.raises(openai.BadRequestError) as error:
        ask(tool_choice={"type": "function", "function": {"name": "get_news"}})
    assert error.value.body["param"] == "tool_choice"
    assert "get_news" in error.value.body["message"]


def test_parameters_that_are_not_an_object_schema_are_a_400(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], max_tokens=4)
    assert error.value.body["param"] == "tools"
