"""The shared tool-calling logic: plans from OpenAI's tools, calls parsed, conversations
rendered in the `<tool_call>` convention, bad tools refused naming the field."""

from __future__ import annotations

import json

import pytest

from tokenmill.loader.chat_template import GEMMA_CHAT_TEMPLATE, render_chat_template
from tokenmill.structured.tools import (
    ToolError,
    chat_template_input,
    plan_tools,
    template_messages,
    template_renders_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
# A chat template in the Hermes / Qwen 2.5 style: it lists the tools itself and writes each
# call as a <tool_call> block of JSON.
HERMES_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}"
    "{{ tool.function | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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


def test_the_packaged_models_templates_leave_tools_to_the_convention(smollm):
    assert not template_renders_tools(smollm.tokenizer.chat_template)
    assert not template_renders_tools(GEMMA_CHAT_TEMPLATE)  # Gemma 3 270M ships no template
    plan = plan_tools([WEATHER], "auto")
    messages, tools = chat_template_input([{"role": "user", "content": "Hi"}], plan, None)
    assert tools is None and messages[0]["role"] == "system"


def test_a_template_with_another_call_syntax_is_left_to_the_convention():
    mistral_style = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]"
    assert not template_renders_tools(mistral_style)


def test_a_template_that_renders_tools_gets_them_and_calls_round_trip():
    assert template_renders_tools(HERMES_STYLE_TEMPLATE)
    plan = plan_tools([WEATHER, TIME], "auto")
    arguments = '{"city": "Oslo"}'
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    rendered, tools = chat_template_input(messages, plan, HERMES_STYLE_TEMPLATE)
    assert [m["role"] for m in rendered] == ["user", "assistant"]  # no convention message
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    prompt = render_chat_template(
        HERMES_STYLE_TEMPLATE,
        rendered,
        add_generation_prompt=False,
        bos_token=None,
        eos_token=None,
        tools=tools,
    )
    assert '{"name": "get_weather"' in prompt.split("<|im_start|>user")[0]
    assistant_turn = prompt.split("<|im_start|>assistant\n")[1]
    (parsed,) = plan.parse(assistant_turn)
    assert (parsed.name, json.loads(parsed.arguments)) == ("get_weather", {"city": "Oslo"})
