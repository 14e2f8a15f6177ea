"""The shared tool-calling logic: plans from OpenAI's tools, calls parsed, conversations
rendered in the `<tool_call>` convention, bad tools refused naming the field."""

from __future__ import annotations

import json

import pytest

from tokenmill.structured.tools import ToolError, plan_tools, template_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_auto_mode_parses_calls_in_the_tool_call_convention():
    plan = plan_tools([WEATHER, TIME], "auto")
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    (call,) = plan.parse(text)
    assert call.name == "get_time"
    assert json.loads(call.arguments) == {"zone": "UTC"}
    assert plan.parse("No call here.") is None


def test_a_reply_with_calls_keeps_the_content_before_them():
    plan = plan_tools([WEATHER, TIME], "auto")
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert plan.reply(text).content == "Sure."
    assert plan.reply(text.removeprefix("Sure. ")).content is None
    assert plan.reply("No call here.").content == "No call here."


def test_required_mode_parses_a_list_of_calls_and_not_a_cut_off_one():
    plan = plan_tools([WEATHER, TIME], "required")
    assert plan.constraint is not None and plan.constraint.kind == "json"
    calls = plan.parse('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert plan.parse('[{"name": "get_weather", "argu') is None


def test_a_named_function_constrains_to_its_arguments():
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert plan.constraint.json == WEATHER["function"]["parameters"]
    (call,) = plan.parse('{"city": "Oslo"}')
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')


def test_no_tools_or_tool_choice_none_leaves_tools_out():
    assert plan_tools(None, None) is None
    assert plan_tools([WEATHER], "none") is None


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param", "words"),
    [
        (
            [WEATHER],
            {"type": "function", "function": {"name": "get_news"}},
            "tool_choice",
            "get_news",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools",
            "object",
        ),
        ([WEATHER, WEATHER], None, "tools", "distinct"),
        (None, "required", "tool_choice", "needs tools"),
        ([WEATHER], "sometimes", "tool_choice", "sometimes"),
        ([{"type": "function", "function": {}}], None, "tools", "must have a name"),
    ],
)
def test_bad_tools_are_a_tool_error_naming_the_field(tools, tool_choice, param, words):
    with pytest.raises(ToolError, match=words) as error:
        plan_tools(tools, tool_choice)
    assert error.value.param == param


def test_tools_are_described_in_the_system_message():
    plan = plan_tools([WEATHER], "auto")
    plain = template_messages([{"role": "user", "content": "Hi"}], plan)
    assert [m["role"] for m in plain] == ["system", "user"]
    assert "get_weather" in plain[0]["content"]
    with_system = template_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], plan
    )
    assert [m["role"] for m in with_system] == ["system", "user"]
    assert with_system[0]["content"].startswith("Be brief.\n\n")


def test_calls_sent_back_are_written_in_the_convention():
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    assistant, tool = template_messages(messages, None)
    assert assistant == {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    }
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "noon"}
