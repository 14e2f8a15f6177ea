"""Tool calling, shared by `LLM.chat` and the server's /v1/chat/completions: the tools described
to the model, its output constrained to a call or its calls parsed from the text.

The model is told about the tools in a system message and asked to answer a call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the convention of Hermes-style and
Qwen templates), since most templates have no tool syntax of their own. With `tool_choice`
`"required"` the output is constrained to a JSON list of calls to the given functions, with a
named function to that function's arguments; with `"auto"` the calls are parsed from the text,
and with `"none"` the tools are left out. Earlier calls and tool results sent back are rendered
in the same convention. Tools and messages come in OpenAI's shapes, as plain dicts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2 import meta

from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.structured.tool_parser import HERMES, ToolCallParser

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICES = ("none", "auto", "required")

ToolMode = Literal["auto", "required", "named"]


class ToolError(ValueError):
    """A bad `tools` or `tool_choice`; `param` names the field for the server's error body."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    """A function the model may call: OpenAI's `tools[i].function`."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's tool shape, as chat templates that render tools read it."""
        function = {"name": self.name, "description": self.description}
        return {
            "type": "function",
            "function": {**function, "parameters": dict(self.parameters or EMPTY_PARAMETERS)},
        }


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; `arguments` is a JSON string, as in OpenAI's API."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's shape, as an assistant message's `tool_calls` entry sent back holds it."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolPlan:
    """How a request uses its tools; `constraint` is the output grammar, if any."""

    mode: ToolMode
    functions: tuple[Function, ...]
    constraint: StructuredOutputsParams | None = None
    function_name: str | None = None  # the named function

    def system_prompt(self) -> str:
        """The system-message text that describes the tools and how to call them."""
        described = [
            {
                "name": f.name,
                "description": f.description,
                "parameters": f.parameters or EMPTY_PARAMETERS,
            }
            for f in self.functions
        ]
        return (
            "You may call these functions:\n"
            + "\n".join(json.dumps(d) for d in described)
            + '\nTo call one, answer with <tool_call>{"name": <name>, "arguments": <object>}'
            "</tool_call>."
        )

    def parser(self) -> ToolCallParser:
        """An incremental parser of this plan's output (tool_parser.py), for a stream."""
        return ToolCallParser(self.mode, self.function_name)

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in a finished `text`; None if it holds none (then it is a plain answer).
        Each call's `arguments` is the model's own text of them, as a stream sends it."""
        return self.reply(text).calls

    def reply(self, text: str) -> ToolReply:
        """A finished `text` as a reply: its calls, and the content before them (all of it when
        it makes no call)."""
        parser = self.parser()
        parser.feed(text)
        parser.finish()
        calls = [ToolCall(c.id, c.name, c.arguments) for c in parser.calls]
        if not calls:
            return ToolReply(text, None)
        return ToolReply(parser.content().strip() or None, calls)


@dataclass(frozen=True)
class ToolReply:
    content: str | None
    calls: list[ToolCall] | None


def plan_tools(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None
) -> ToolPlan | None:
    """The request's use of tools (None: no tools in play). `tools` and `tool_choice` are
    OpenAI's; a bad one raises ToolError naming the field."""
    functions = tuple(_function(tool, index) for index, tool in enumerate(tools or []))
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise ToolError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
            f"got {choice!r}",
            "tool_choice",
        )
    if not functions:
        if choice != "none":
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ToolError(f"tools must have distinct function names, got {names}", "tools")
    if choice == "none":
        return None
    if choice == "auto":
        return ToolPlan("auto", functions)
    if choice == "required":
        return ToolPlan("required", functions, _calls_schema(functions))
    name = _named_function(choice)
    chosen = next((f for f in functions if f.name == name), None)
    if chosen is None:
        raise ToolError(
            f"tool_choice names function {name!r}, which is not among the tools {names}",
            "tool_choice",
        )
    parameters = dict(chosen.parameters or EMPTY_PARAMETERS)
    return ToolPlan("named", functions, StructuredOutputsParams(json=parameters), name)


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template describes the tools itself (it reads `tools`) and has the model
    write each call as a `<tool_call>` block of JSON with its name and arguments (Hermes, Qwen
    2.5 and Qwen 3 templates): the syntax the parser reads. A template with another call syntax
    (Llama 3's, Mistral's, XML inside `<tool_call>`) is left to the convention."""
    if not chat_template or "tools" not in _template_variables(chat_template):
        return False
    json_calls = '"arguments"' in chat_template and "<function=" not in chat_template
    return HERMES.start in chat_template and HERMES.end in chat_template and json_calls


def chat_template_input(
    messages: Sequence[Mapping[str, Any]], plan: ToolPlan | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the `tools` to render it with: a template that renders tools in a
    syntax the parser reads (`template_renders_tools`) gets them, and earlier calls as OpenAI
    messages (arguments parsed, as such templates expect); any other gets no tools and the
    convention written into its messages (`template_messages`)."""
    if plan is None or not template_renders_tools(chat_template):
        return template_messages(messages, plan), None
    rendered = []
    for message in messages:
        copy = {**message, "content": message.get("content") or ""}
        if message.get("tool_calls"):
            copy["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _loads(call["function"])}}
                for call in message["tool_calls"]
            ]
        rendered.append(copy)
    return rendered, [function.as_openai() for function in plan.functions]


def template_messages(
    messages: Sequence[Mapping[str, Any]], plan: ToolPlan | None
) -> list[dict[str, Any]]:
    """The conversation for the chat template: the tools described up front, earlier tool calls
    and tool results written in the `<tool_call>` convention."""
    rendered = [_template_message(m) for m in messages]
    if plan is None:
        return rendered
    if rendered and rendered[0]["role"] in ("system", "developer"):
        first = rendered[0]
        rendered[0] = {**first, "content": f"{first['content']}\n\n{plan.system_prompt()}"}
        return rendered
    return [{"role": "system", "content": plan.system_prompt()}, *rendered]


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One message as the template sees it: content a string, tool calls written into it."""
    rendered = {k: v for k, v in message.items() if k != "tool_calls"}
    rendered["content"] = rendered.get("content") or ""
    calls = message.get("tool_calls") or []
    if calls:
        written = "\n".join(
            "<tool_call>"
            + json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"])})
            + "</tool_call>"
            for c in calls
        )
        content = rendered["content"]
        rendered["content"] = f"{content}\n{written}" if content else written
    return rendered


def _function(tool: Mapping[str, Any], index: int) -> Function:
    """OpenAI's `{"type": "function", "function": {...}}`, checked."""
    field = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise ToolError(f"{field} must be a tool of type function, got {tool!r}", "tools")
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ToolError(f"{field}.function must have a name, got {function!r}", "tools")
    parameters = function.get("parameters")
    if parameters is not None and (
        not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object"
    ):
        kind = parameters.get("type") if isinstance(parameters, Mapping) else parameters
        raise ToolError(
            f"{field}.function.parameters must be a JSON schema of type object, got {kind!r}",
            "tools",
        )
    return Function(function["name"], function.get("description") or "", parameters)


def _named_function(choice: Mapping[str, Any] | str) -> str:
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ToolError(
            f'tool_choice must be none, auto, required or {{"type": "function", "function": '
            f'{{"name": ...}}}}, got {choice!r}',
            "tool_choice",
        )
    return function["name"]


def _calls_schema(functions: tuple[Function, ...]) -> StructuredOutputsParams:
    """A JSON list of at least one call, each to one of `functions` with valid arguments."""
    one_call = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": dict(f.parameters or EMPTY_PARAMETERS),
            },
            "required": ["name", "arguments"],
        }
        for f in functions
    ]
    return StructuredOutputsParams(
        json={"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    )


def _loads(function: Mapping[str, Any]) -> Any:
    """A sent-back call's arguments: OpenAI's JSON string, parsed (or left as it is)."""
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


_PARSER = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])


@functools.lru_cache(maxsize=16)
def _template_variables(chat_template: str) -> frozenset[str]:
    """The variables a template reads from its caller."""
    try:
        return frozenset(meta.find_undeclared_variables(_PARSER.parse(chat_template)))
    except jinja2.TemplateError:
        return frozenset()
