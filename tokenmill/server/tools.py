"""Tool calling on /v1/chat/completions: the request's tools and messages handed to the shared
tool logic (tokenmill/structured/tools.py), its errors as 400s and its calls as response models."""

from __future__ import annotations

from typing import Any

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tokenmill.structured import tools
from tokenmill.structured.tool_parser import ToolEvents
from tokenmill.structured.tools import ToolPlan


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's use of tools (None: no tools in play); bad tools or tool_choice are 400s."""
    choice = req.tool_choice
    try:
        return tools.plan_tools(
            [tool.model_dump(exclude_none=True) for tool in req.tools or []],
            choice if choice is None or isinstance(choice, str) else choice.model_dump(),
        )
    except tools.ToolError as exc:
        raise bad_request(str(exc), exc.param) from exc


def chat_template_input(
    messages: list[ChatMessage], plan: ToolPlan | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation for the chat template and the tools it renders itself, if it does;
    otherwise the tools and earlier calls written into the messages."""
    return tools.chat_template_input([_openai_message(m) for m in messages], plan, chat_template)


def tool_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A finished choice's content and calls, as the response carries them."""
    reply = plan.reply(text)
    if reply.calls is None:
        return reply.content, None
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in reply.calls
    ]
    return reply.content, calls


def tool_call_deltas(events: ToolEvents) -> list[DeltaToolCall] | None:
    """A stream's tool-call deltas for what a piece of output added: a call's first delta has
    its id, type and name (and the arguments so far), later ones fragments of its arguments."""
    fragments = dict(events.arguments)
    deltas = [
        DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=fragments.pop(call.index, "")),
        )
        for call in events.started
    ]
    deltas += [
        DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))
        for index, fragment in sorted(fragments.items())
    ]
    return deltas or None


def _openai_message(message: ChatMessage) -> dict[str, Any]:
    rendered = message.as_template_message()
    if message.tool_calls:
        rendered["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.role == "tool" and message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered
