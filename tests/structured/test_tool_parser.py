"""The incremental tool-call parser: what a stream sends piece by piece adds up to the calls the
whole text parses to, the name sent as soon as it is complete and the arguments as they grow."""

from __future__ import annotations

import json

from tokenmill.structured.tool_parser import ToolCallParser, ToolEvents

REQUIRED = (
    '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": {}}]'
)


def fed_in_pieces(parser: ToolCallParser, text: str, size: int = 1) -> list[ToolEvents]:
    events = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    return [*events, parser.finish()]


def whole(mode: str, text: str, function_name: str | None = None) -> ToolCallParser:
    parser = ToolCallParser(mode, function_name)
    parser.feed(text)
    parser.finish()
    return parser


def test_streamed_required_calls_add_up_to_the_whole_texts_calls():
    parser = ToolCallParser("required", None)
    events = fed_in_pieces(parser, REQUIRED)
    started = [call.name for e in events for call in e.started]
    arguments = {0: "", 1: ""}
    for e in events:
        for index, fragment in e.arguments.items():
            arguments[index] += fragment
    expected = whole("required", REQUIRED).calls
    assert started == [call.name for call in expected] == ["get_weather", "get_time"]
    assert [arguments[0], arguments[1]] == [call.arguments for call in expected]
    assert json.loads(arguments[0]) == {"city": "Oslo"} and arguments[1] == "{}"


def test_a_calls_name_is_sent_once_complete_and_its_arguments_as_they_grow():
    parser = ToolCallParser("required", None)
    assert not parser.feed('[{"name": "get_wea')
    head = parser.feed('ther", "arguments": {"ci')
    assert [call.name for call in head.started] == ["get_weather"]
    assert head.arguments == {0: '{"ci'}
    assert parser.feed('ty": "Oslo"}}]').arguments == {0: 'ty": "Oslo"}'}


def test_braces_and_quotes_inside_argument_strings_do_not_end_the_arguments():
    arguments = '{"q": "a}b\\"c{", "n": [1, {"x": "]"}]}'
    text = f'[{{"name": "search", "arguments": {arguments}}}]'
    (call,) = whole("required", text).calls
    assert call.arguments == arguments


def test_named_mode_starts_the_call_at_once_and_streams_the_whole_text_as_arguments():
    parser = ToolCallParser("named", "get_weather")
    first = parser.feed('{"city"')
    assert [call.name for call in first.started] == ["get_weather"]
    assert parser.feed(': "Oslo"}').arguments == {0: ': "Oslo"}'}
    assert parser.calls[0].arguments == '{"city": "Oslo"}'


def test_auto_mode_streams_content_holding_back_a_marker_being_generated():
    parser = ToolCallParser("auto", None)
    assert parser.feed("Let me check. <tool").content == "Let me check. "
    events = parser.feed('_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    assert events.content == ""
    assert [call.name for call in events.started] == ["get_time"]
    assert parser.calls[0].arguments == '{"zone": "UTC"}'
    parser.finish()
    assert parser.content() == "Let me check. "


def test_auto_mode_text_without_a_call_is_all_content_at_the_end():
    text = "Use <tool_call>not json</tool_call> like <tool"
    parser = ToolCallParser("auto", None)
    sent = "".join(e.content for e in fed_in_pieces(parser, text, size=3))
    assert sent == text and parser.calls == []


def test_auto_mode_parses_a_call_written_arguments_first_once_its_block_closes():
    block = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
    parser = ToolCallParser("auto", None)
    assert not parser.feed(block[:-3]).started
    events = parser.feed(block[-3:])
    assert [call.name for call in events.started] == ["get_weather"]
    assert json.loads(events.arguments[0]) == {"city": "Rome"}
