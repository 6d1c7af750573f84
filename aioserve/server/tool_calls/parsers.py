"""Tool-call parsers: a model's output read as content and tool calls, as vLLM's parsers do.

Each parser reads the whole output so far (`read(text, final)`) into a `ParsedOutput`: the
content that is safe to send (never a piece of a tool-call marker still arriving) and the
calls seen so far, each with its name once known and the raw text of its arguments so far.
Raw text only grows as the output grows, so a stream sends each call's arguments as the
difference from the last read (streaming.py), and the pieces join to the arguments the
complete output gives. `final=True` reads a finished output: a call left unfinished, or
whose arguments are not valid JSON, makes the whole output content, as in vLLM.

Formats (vLLM's names):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more, after
  optional content;
- `llama3_json`: an output that starts with `{` (after an optional `<|python_tag|>`):
  `{"name": ..., "parameters": {...}}` objects separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects, or
  (newer tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call;
- `pythonic`: an output that is a Python list of calls, `[f(a=1), g(b="x")]`; each call is
  sent whole once its closing parenthesis arrives (its keyword arguments as JSON).

`register_tool_parser` adds a parser by name (what a --tool-parser-plugin file calls).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from aioserve.server.tool_calls.partial_json import (
    object_members,
    skip_whitespace,
    value_end,
)


@dataclass
class CallSoFar:
    name: str | None  # None until its name is complete
    arguments: str  # the raw text of its arguments so far
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str
    calls: list[CallSoFar] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def content_until(text: str, marker: str, final: bool) -> tuple[str, int]:
    """(the content before `marker`, where the marker starts or -1). Before the marker
    appears, an ending that could begin it is held back unless the output is final."""
    start = text.find(marker)
    if start >= 0:
        return text[:start], start
    keep = 0 if final else held_back(text, marker)
    return text[: len(text) - keep], -1


def call_from_object(
    text: str, pos: int, arguments_keys: tuple[str, ...]
) -> tuple[CallSoFar, int | None]:
    """The call in the JSON object at text[pos] == '{', and the index after it (None while
    it is open). Its name counts only once its arguments have begun: an object without
    them is not a call (`{"name": "Bob", "age": 30}`)."""
    members, end = object_members(text, pos)
    name = None
    has_arguments = any(key in members for key in arguments_keys)
    if has_arguments and "name" in members and members["name"].end is not None:
        name = json.loads(text[members["name"].start : members["name"].end])
        if not isinstance(name, str):
            raise ValueError("a tool call's name must be a string")
    arguments = ""
    for key in arguments_keys:
        if key in members:
            span = members[key]
            arguments = text[span.start : span.end if span.end is not None else len(text)]
            break
    return CallSoFar(name, arguments, complete=end is not None), end


def calls_in_array(text: str, pos: int, arguments_keys: tuple[str, ...]) -> list[CallSoFar]:
    """The calls of the JSON array of call objects at text[pos] == '['."""
    calls = []
    pos = skip_whitespace(text, pos + 1)
    while pos < len(text) and text[pos] == "{":
        call, end = call_from_object(text, pos, arguments_keys)
        calls.append(call)
        if end is None:
            break
        pos = skip_whitespace(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_whitespace(text, pos + 1)
    return calls


def checked(parsed: ParsedOutput, text: str, final: bool) -> ParsedOutput:
    """A final output whose calls are not all complete, named, with JSON arguments: all
    content."""
    if not final or not parsed.calls:
        return parsed
    for call in parsed.calls:
        if not (call.complete and call.name and call.arguments):
            return ParsedOutput(text)  # a call needs its arguments (or parameters), as in vLLM
        try:
            json.loads(call.arguments)
        except json.JSONDecodeError:
            return ParsedOutput(text)
    return parsed


class ToolParser:
    """One format; `read` is safe to call on any prefix of an output."""

    name = ""
    skip_special_tokens = True  # False where the markers are special tokens

    def read(self, text: str, final: bool) -> ParsedOutput:
        try:
            parsed = self.parse(text, final)
        except (ValueError, SyntaxError):
            return ParsedOutput(text) if final else ParsedOutput("")
        return checked(parsed, text, final)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    skip_special_tokens = False
    start = "<tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self.start, final)
        parsed = ParsedOutput(content)
        while start >= 0:
            pos = skip_whitespace(text, start + len(self.start))
            if pos >= len(text):
                break
            call, end = call_from_object(text, pos, ("arguments", "parameters"))
            parsed.calls.append(call)
            if end is None:
                break
            start = text.find(self.start, end)
        return parsed


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        if text.startswith(self.tag, pos):
            pos = skip_whitespace(text, pos + len(self.tag))
        elif not final and self.tag.startswith(text[pos:]):
            return ParsedOutput("")  # could still become the tag
        if pos >= len(text):
            return ParsedOutput("" if not final else text)
        if text[pos] != "{":
            return ParsedOutput(text)
        parsed = ParsedOutput("")
        while pos < len(text) and text[pos] == "{":
            call, end = call_from_object(text, pos, ("parameters", "arguments"))
            parsed.calls.append(call)
            if end is None:
                break
            pos = skip_whitespace(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_whitespace(text, pos + 1)
        return parsed


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False
    marker, args = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self.marker, final)
        parsed = ParsedOutput(content)
        if start < 0:
            return parsed
        pos = skip_whitespace(text, start + len(self.marker))
        if pos < len(text) and text[pos] == "[":  # a JSON array of calls
            parsed.calls = calls_in_array(text, pos, ("arguments", "parameters"))
            return parsed
        while start >= 0:  # name[ARGS]{...}, each call after its own marker
            pos = start + len(self.marker)
            args = text.find(self.args, pos)
            if args < 0:
                break
            value = skip_whitespace(text, args + len(self.args))
            end = value_end(text, value)
            arguments = text[value : end if end is not None else len(text)]
            parsed.calls.append(CallSoFar(text[pos:args].strip(), arguments, end is not None))
            if end is None:
                break
            start = text.find(self.marker, end)
        return parsed


class PythonicParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        if pos >= len(text):
            return ParsedOutput("" if not final else text)
        if text[pos] != "[":
            return ParsedOutput(text)
        parsed = ParsedOutput("")
        segments = _complete_calls(text, pos + 1)
        if final and not segments:
            return ParsedOutput(text)  # a list, but of no call: content
        for segment in segments:
            call = ast.parse(segment.strip(), mode="eval").body
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                raise ValueError("a pythonic tool call is name(keyword=value, ...)")
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            parsed.calls.append(
                CallSoFar(call.func.id, json.dumps(arguments, ensure_ascii=False), True)
            )
        return parsed


def _complete_calls(text: str, pos: int) -> list[str]:
    """The calls of a pythonic list whose closing parenthesis has arrived."""
    calls, depth, start, quote = [], 0, pos, None
    while pos < len(text):
        char = text[pos]
        if quote:
            if char == "\\":
                pos += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                break  # the list's own closing bracket
            depth -= 1
            if depth == 0 and char == ")":
                calls.append(text[start : pos + 1].lstrip(", \n"))
                start = pos + 1
        pos += 1
    return calls


_PARSERS: dict[str, Callable[[], ToolParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """A class decorator that makes a ToolParser subclass --tool-call-parser `name`."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def new_tool_parser(name: str) -> ToolParser:
    return _PARSERS[name]()
