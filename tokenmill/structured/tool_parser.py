"""Tool calls read from a model's output as it grows: the pieces a stream sends, and the calls.

The parser is fed the output text piece by piece and returns what can be sent so far: plain
content, a call's start (its id and function name) once the name is complete, then fragments of
the call's `arguments` as they are generated, as OpenAI streams them. A finished text parsed in
one piece gives the same calls, so a stream and a whole response always agree.

What is parsed depends on the plan's mode (tools.py): with a named function the whole output is
the arguments; with `"required"` it is the list `[{"name": ..., "arguments": ...}, ...]`; with
`"auto"` each call sits in a block of the template's tool syntax (`ToolSyntax`: by default
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), and the text before the first block
is content. A block whose call does not start with its name is parsed whole once it closes.
Text after the first block, outside blocks, is dropped; a text with no call is all content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

# A call's start: its name, then the key of its arguments, whatever the whitespace.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
_OPENERS = {"{": "}", "[": "]"}


@dataclass(frozen=True)
class ToolSyntax:
    """How a model writes a call in `"auto"` mode: a JSON call between these two markers."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"


HERMES = ToolSyntax()


@dataclass
class ParsedCall:
    index: int  # its place among the output's calls
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolEvents:
    """What a piece of output adds: content, calls started, and argument fragments by call."""

    content: str = ""
    started: list[ParsedCall] = field(default_factory=list)
    arguments: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments)

    def extend(self, later: ToolEvents) -> None:
        self.content += later.content
        self.started += later.started
        for index, fragment in later.arguments.items():
            self.arguments[index] = self.arguments.get(index, "") + fragment


class _ValueScanner:
    """Finds where one JSON value ends, a character at a time: brackets, strings and escapes."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them until it ends)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._end(i + 1)
            elif char == '"':
                self.in_string, self.started = True, True
            elif char in _OPENERS:
                self.depth, self.started = self.depth + 1, True
            elif char in "}]":
                if self.depth == 0:  # a scalar ended by its container's closing bracket
                    return self._end(i)
                self.depth -= 1
                if self.depth == 0:
                    return self._end(i + 1)
            elif self.depth == 0 and self.started and (char in ", \n\t\r"):
                return self._end(i)
            elif not char.isspace():
                self.started = True
        return len(text)

    def _end(self, count: int) -> int:
        self.done = True
        return count


class ToolCallParser:
    """Feed it the output's new text with `feed`, then call `finish` once the output ended."""

    def __init__(self, mode: str, function_name: str | None, syntax: ToolSyntax = HERMES) -> None:
        self._mode = mode
        self._function_name = function_name
        self._syntax = syntax
        self._text = ""
        self._pos = 0  # characters of the text dealt with
        self._content_end = 0  # characters of the text sent as content
        self._state = "content" if mode == "auto" else "call"
        self._block_start = 0  # "auto": where the current block's body starts
        self._scanner: _ValueScanner | None = None
        self.calls: list[ParsedCall] = []

    def feed(self, new_text: str) -> ToolEvents:
        self._text += new_text
        events = ToolEvents()
        while self._step(events):
            pass
        return events

    def finish(self) -> ToolEvents:
        """The rest, at the output's end: a text that made no call is all content."""
        events = ToolEvents()
        if self._mode == "auto" and not self.calls:
            events.content = self._text[self._content_end :]
            self._content_end = len(self._text)
        return events

    def content(self) -> str:
        """All the content sent so far (with `finish`: the answer's content)."""
        return self._text[: self._content_end]

    def _step(self, events: ToolEvents) -> bool:
        """Advance through one state; False when the text so far is used up."""
        text, pos = self._text, self._pos
        if self._state == "content":
            start = text.find(self._syntax.start, pos)
            if start < 0:
                held = _partial_suffix(text, self._syntax.start)
                self._send_content(events, len(text) - held)
                return False
            self._send_content(events, start)
            return self._open_block(start)
        if self._state == "outside":  # after the first block: only further blocks matter
            start = text.find(self._syntax.start, pos)
            return start >= 0 and self._open_block(start)
        if self._state == "call":
            if self._mode == "named":
                self._start_call(events, self._function_name or "")
                return True
            head = _CALL_HEAD.search(text, pos)
            if head is None:
                return False
            self._pos = head.end()
            self._start_call(events, json.loads(head.group(1)))
            return True
        if self._state == "block":
            head = _CALL_HEAD.match(text, pos)
            if head is not None:
                self._pos = head.end()
                self._start_call(events, json.loads(head.group(1)))
                return True
            end = text.find(self._syntax.end, pos)
            if end < 0:
                return False
            self._parse_whole_block(events, text[pos:end])
            self._pos, self._state = end + len(self._syntax.end), "outside"
            return True
        if self._state == "arguments":
            assert self._scanner is not None
            if not self._scanner.started:  # the arguments begin at their first character
                pos = len(text) - len(text[pos:].lstrip())
            used = self._scanner.feed(text[pos:])
            fragment = text[pos : pos + used]
            if fragment:
                index = len(self.calls) - 1
                self.calls[index].arguments += fragment
                events.arguments[index] = events.arguments.get(index, "") + fragment
            self._pos = pos + used
            if not self._scanner.done:
                return False
            self._state = {"auto": "block_end", "required": "call"}.get(self._mode, "done")
            return True
        if self._state == "block_end":
            end = text.find(self._syntax.end, pos)
            if end < 0:
                return False
            self._pos, self._state = end + len(self._syntax.end), "outside"
            return True
        return False  # "done"

    def _send_content(self, events: ToolEvents, end: int) -> None:
        if not self.calls and self._state == "content" and end > self._content_end:
            events.content += self._text[self._content_end : end]
            self._content_end = end
        self._pos = max(self._pos, end)

    def _open_block(self, start: int) -> bool:
        self._pos = start + len(self._syntax.start)
        self._state = "block"
        return True

    def _start_call(self, events: ToolEvents, name: str) -> None:
        call = ParsedCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        events.started.append(call)
        self._scanner = _ValueScanner()
        self._state = "arguments"

    def _parse_whole_block(self, events: ToolEvents, body: str) -> None:
        try:
            parsed: Any = json.loads(body)
        except json.JSONDecodeError:
            return
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            self._start_call(events, parsed["name"])
            arguments = json.dumps(parsed.get("arguments", {}))
            self.calls[-1].arguments = arguments
            events.arguments[len(self.calls) - 1] = arguments


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may be a
    marker still being generated)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
