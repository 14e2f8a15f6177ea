"""Tool calling on /v1/chat/completions: the tools in the prompt, the call constrained or parsed.

The model is told about the tools in a system message and asked to answer a call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the convention of Hermes-style and
Qwen templates), since most templates have no tool syntax of their own. With `tool_choice`
`"required"` the output is constrained to a JSON list of such calls to the given functions, with
a named function to that function's arguments; with `"auto"` the calls are parsed from the text,
and with `"none"` the tools are left out. Earlier calls and tool results sent back are rendered
in the same convention.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    ToolCall,
)

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """How a request uses its tools; `constraint` is the output grammar, if any."""

    mode: ToolMode
    functions: tuple[FunctionDefinition, ...]
    constraint: StructuredOutputsParams | None = None
    function_name: str | None = None  # the named function

    def system_prompt(self) -> str:
        """The system-message text that describes the tools and how to call them."""
        described = [
            {
                "name": f.name,
                "description": f.description or "",
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

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in `text`; None if it holds none (then it is a plain answer)."""
        if self.mode == "named":
            assert self.function_name is not None
            return [_call(self.function_name, _arguments_text(text))]
        if self.mode == "required":
            try:
                calls = [_call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
            except (json.JSONDecodeError, KeyError, TypeError):
                return None  # cut off by max_tokens before the list was complete
            return calls or None
        found = []
        for body in TOOL_CALL.findall(text):
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                found.append(_call(call["name"], json.dumps(call.get("arguments", {}))))
        return found or None


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's use of tools (None: no tools in play); bad tools or tool_choice are 400s."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = tuple(_checked(tool.function, index) for index, tool in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request(f"tools must have distinct function names, got {names}", "tools")
    if choice == "none":
        return None
    if choice == "auto":
        return ToolPlan("auto", functions)
    if choice == "required":
        return ToolPlan("required", functions, _calls_schema(functions))
    name = choice.function.name
    chosen = next((f for f in functions if f.name == name), None)
    if chosen is None:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not among the tools {names}",
            "tool_choice",
        )
    parameters = chosen.parameters or EMPTY_PARAMETERS
    return ToolPlan("named", functions, StructuredOutputsParams(json=parameters), name)


def template_messages(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
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


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered = message.as_template_message()
    if message.tool_calls:
        calls = "\n".join(
            "<tool_call>"
            + json.dumps({"name": c.function.name, "arguments": _loads(c.function.arguments)})
            + "</tool_call>"
            for c in message.tool_calls
        )
        rendered["content"] = f"{rendered['content']}\n{calls}" if rendered["content"] else calls
    if message.role == "tool" and message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _checked(function: FunctionDefinition, index: int) -> FunctionDefinition:
    parameters = function.parameters
    if parameters is not None and parameters.get("type", "object") != "object":
        raise bad_request(
            f"tools[{index}].function.parameters must be a JSON schema of type object, "
            f"got type {parameters.get('type')!r}",
            "tools",
        )
    return function


def _calls_schema(functions: tuple[FunctionDefinition, ...]) -> StructuredOutputsParams:
    """A JSON list of at least one call, each to one of `functions` with valid arguments."""
    one_call = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": f.parameters or EMPTY_PARAMETERS,
            },
            "required": ["name", "arguments"],
        }
        for f in functions
    ]
    return StructuredOutputsParams(
        json={"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    )


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments)
    )


def _arguments_text(text: str) -> str:
    """Arguments as compact JSON when they parse (a cut-off output is passed on as it is)."""
    try:
        return json.dumps(json.loads(text))
    except json.JSONDecodeError:
        return text


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
