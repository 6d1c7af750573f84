"""Tool-call parsers: a model's output read as content and tool calls, as vLLM's parsers do.

Each parser reads the whole output so far (`read(text, final)`) into a `ParsedOutput`: the
content that is safe to send (never a piece of a tool-call marker still arriving) and the
calls seen so far, each with its name once known and its arguments so far. The arguments
only grow as the output grows, so a stream sends each call's arguments as the difference
from the last read (streaming.py). `final=True` reads the end of a stream: a call left
unfinished, or whose arguments are not valid JSON, makes the whole output content.
`read_whole` reads a finished output that was not streamed, as vLLM's non-streaming
extraction does; where vLLM re-serialises the arguments there
(`json.dumps(..., ensure_ascii=False)`), so does it.

Formats (vLLM's names):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more, after
  optional content; streamed as the model wrote the arguments, re-serialised when whole;
- `llama3_json`: `{"name": ..., "parameters": {...}}` objects separated by `;`, streamed
  from an output that starts with `{` (after an optional `<|python_tag|>`), found anywhere
  in a whole output; re-serialised in both modes;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects (or one
  bare object), or (newer tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call; ids of 9
  letters and digits;
- `pythonic`: an output that is a Python list of calls, `[f(a=1), g(b="x")]`; each call is
  sent whole once its closing parenthesis arrives (its keyword arguments as JSON).

More of vLLM's formats live in modules named for their kind, each registered here by
`register_tool_parser` when the package is imported: json_list_formats.py (`granite`,
`phi4_mini_json`, `xlam`), special_token_formats.py (`internlm`, `deepseek_v3`) and
xml_formats.py (`qwen3_coder`, whose parameter values are typed by the request's tool
schemas: `new_tool_parser` hands every parser the request's `tools`).

`register_tool_parser` adds a parser by name (what a --tool-parser-plugin file calls).
"""

from __future__ import annotations

import ast
import json
import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aioserve.server.tool_calls.partial_json import (
    canonical_prefix,
    object_members,
    skip_whitespace,
    value_end,
)


@dataclass
class CallSoFar:
    name: str | None  # None until its name is complete
    arguments: str  # its arguments so far (the model's text, or re-serialised)
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


def content_until(text: str, marker: str | tuple[str, ...], final: bool) -> tuple[str, int]:
    """(the content before `marker` (the first of several), where it starts or -1). Before
    it appears, an ending that could begin it is held back unless the output is final."""
    markers = (marker,) if isinstance(marker, str) else marker
    starts = [start for start in (text.find(each) for each in markers) if start >= 0]
    if starts:
        return text[: min(starts)], min(starts)
    keep = 0 if final else max(held_back(text, each) for each in markers)
    return text[: len(text) - keep], -1


def call_from_object(
    text: str, pos: int, arguments_keys: tuple[str, ...], missing_arguments: str | None = None
) -> tuple[CallSoFar, int | None]:
    """The call in the JSON object at text[pos] == '{', and the index after it (None while
    it is open). Its name counts only once its arguments have begun: an object without
    them is not a call (`{"name": "Bob", "age": 30}`), unless `missing_arguments` are
    given, which a finished object with a name and no arguments takes (vLLM's `{}`)."""
    members, end = object_members(text, pos)
    name = None
    has_arguments = any(key in members for key in arguments_keys)
    defaulted = not has_arguments and end is not None and missing_arguments is not None
    if (has_arguments or defaulted) and "name" in members and members["name"].end is not None:
        name = json.loads(text[members["name"].start : members["name"].end])
        if not isinstance(name, str):
            raise ValueError("a tool call's name must be a string")
    arguments = missing_arguments if defaulted else ""
    for key in arguments_keys:
        if key in members:
            span = members[key]
            arguments = text[span.start : span.end if span.end is not None else len(text)]
            break
    return CallSoFar(name, arguments, complete=end is not None), end


def calls_in_array(
    text: str, pos: int, arguments_keys: tuple[str, ...], missing_arguments: str | None = None
) -> list[CallSoFar]:
    """The calls of the JSON array of call objects at text[pos] == '['."""
    calls = []
    pos = skip_whitespace(text, pos + 1)
    while pos < len(text) and text[pos] == "{":
        call, end = call_from_object(text, pos, arguments_keys, missing_arguments)
        calls.append(call)
        if end is None:
            break
        pos = skip_whitespace(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_whitespace(text, pos + 1)
    return calls


def checked(
    parsed: ParsedOutput, text: str, final: bool, json_arguments: bool = True
) -> ParsedOutput:
    """A final output whose calls are not all complete, named, with arguments (JSON ones
    unless `json_arguments` is False): all content."""
    if not final or not parsed.calls:
        return parsed
    for call in parsed.calls:
        if not (call.complete and call.name and call.arguments):
            return ParsedOutput(text)  # a call needs its arguments (or parameters), as in vLLM
        if not json_arguments:
            continue
        try:
            json.loads(call.arguments)
        except json.JSONDecodeError:
            return ParsedOutput(text)
    return parsed


def reserialised(arguments: Any) -> str:
    """Arguments as vLLM writes the ones it re-serialises."""
    return json.dumps(arguments, ensure_ascii=False)


def new_tool_call_id() -> str:
    """vLLM's default tool-call id: "chatcmpl-tool-" and 16 hex digits (vllm/utils
    random_uuid, used by renderers/chat_utils.py make_tool_call_id)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (1 << 64) - 1:016x}"


class ToolParser:
    """One format; `read` is safe to call on any prefix of an output."""

    name = ""
    skip_special_tokens = True  # False where the markers are special tokens
    json_arguments = True  # False where vLLM passes the model's arguments on unchecked
    structural_form: str | None = None  # its calls' structural tag (strict_tags.py)
    tools: Sequence[dict[str, Any]] = ()  # the request's tools (set by new_tool_parser)

    def read(self, text: str, final: bool) -> ParsedOutput:
        try:
            parsed = self.parse(text, final)
        except (ValueError, SyntaxError):
            return ParsedOutput(text) if final else ParsedOutput("")
        return checked(parsed, text, final, self.json_arguments)

    def read_whole(self, text: str) -> ParsedOutput:
        """A finished output that was not streamed."""
        return self.read(text, final=True)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return new_tool_call_id()


class HermesParser(ToolParser):
    name = "hermes"
    skip_special_tokens = False
    structural_form = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def read_whole(self, text: str) -> ParsedOutput:
        # vLLM hermes_tool_parser.py extract_tool_calls: every tag's body (up to its
        # closing tag, or the end) must be one JSON call, else the output is content.
        first = text.find(self.start)
        if first < 0:
            return ParsedOutput(text)
        parsed = ParsedOutput(text[:first])
        start = first
        while start >= 0:
            body = start + len(self.start)
            close = text.find(self.end, body)
            try:
                value = json.loads(text[body : close if close >= 0 else len(text)])
                parsed.calls.append(_whole_call(value, ("arguments", "parameters")))
            except (ValueError, TypeError, KeyError):
                return ParsedOutput(text)
            if close < 0:
                break
            start = text.find(self.start, close + len(self.end))
        return parsed

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
    structural_form = "llama"
    tag = "<|python_tag|>"

    def read_whole(self, text: str) -> ParsedOutput:
        # vLLM llama_tool_parser.py extract_tool_calls: every JSON object that starts at
        # a '{' outside the ones already read is a call, the text around them dropped; one
        # that is not JSON or not a call makes the output content.
        decoder = json.JSONDecoder()
        calls: list[CallSoFar] = []
        pos = text.find("{")
        while pos >= 0:
            try:
                value, end = decoder.raw_decode(text, pos)
                calls.append(_whole_call(value, ("arguments", "parameters")))
            except (ValueError, TypeError, KeyError):
                return ParsedOutput(text)
            pos = text.find("{", end)
        return ParsedOutput("", calls) if calls else ParsedOutput(text)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        # vLLM streams only an output that starts with the tag or '{'.
        pos = 0
        if text.startswith(self.tag):
            pos = skip_whitespace(text, len(self.tag))
        elif not final and self.tag.startswith(text):
            return ParsedOutput("")  # could still become the tag
        if pos >= len(text):
            return ParsedOutput("" if not final else text)
        if text[pos] != "{":
            return ParsedOutput(text)
        parsed = ParsedOutput("")
        while pos < len(text) and text[pos] == "{":
            call, end = call_from_object(text, pos, ("parameters", "arguments"))
            # Streamed re-serialised, as vLLM streams it (llama_tool_parser.py).
            call.arguments = canonical_prefix(call.arguments, call.complete)
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

    def new_call_id(self) -> str:
        # vLLM parser/mistral.py MistralToolCall: Mistral's validator wants 9 of these.
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def read_whole(self, text: str) -> ParsedOutput:
        parsed = self.read(text, final=True)
        if parsed.has_calls and self._json_calls(text):
            # vLLM parser/mistral.py _pre_v11_function_calls: arguments re-serialised,
            # a string kept as it is.
            for call in parsed.calls:
                value = json.loads(call.arguments)
                call.arguments = value if isinstance(value, str) else reserialised(value)
        return parsed

    def _json_calls(self, text: str) -> bool:
        """Whether the calls are JSON objects (not name[ARGS]{...})."""
        pos = skip_whitespace(text, text.find(self.marker) + len(self.marker))
        return text[pos : pos + 1] in ("[", "{")

    def parse(self, text: str, final: bool) -> ParsedOutput:
        parsed = self._parse(text, final)
        if final and not parsed.has_calls:
            return ParsedOutput(text)  # the text held back after the marker is content
        return parsed

    def _parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self.marker, final)
        parsed = ParsedOutput(content)
        if start < 0:
            return parsed
        pos = skip_whitespace(text, start + len(self.marker))
        if pos < len(text) and text[pos] == "[":  # a JSON array of calls
            parsed.calls = calls_in_array(text, pos, ("arguments", "parameters"))
            return parsed
        if pos < len(text) and text[pos] == "{":  # one bare call object (vLLM's too)
            parsed.calls = [call_from_object(text, pos, ("arguments", "parameters"))[0]]
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
        if not text:
            return ParsedOutput("")
        if text[0] != "[":  # vLLM's pattern must match from the first character
            return ParsedOutput(text)
        parsed = ParsedOutput("")
        segments = _complete_calls(text, 1)
        if final and not segments:
            return ParsedOutput(text)  # a list, but of no call: content
        if final:
            # vLLM pythonic_tool_parser.py parses the whole output: text after the
            # list makes it content.
            ast.parse(text)
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


def _whole_call(value: Any, arguments_keys: tuple[str, ...]) -> CallSoFar:
    """A decoded call object as a finished call; KeyError or TypeError if it is not one."""
    name = value["name"]
    if not isinstance(name, str):
        raise TypeError("a tool call's name must be a string")
    key = next((key for key in arguments_keys if key in value), arguments_keys[0])
    return CallSoFar(name, reserialised(value[key]), complete=True)


_ALPHANUMERIC = string.ascii_letters + string.digits

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


def new_tool_parser(name: str, tools: Sequence[dict[str, Any]] | None = None) -> ToolParser:
    """A parser of format `name` for one request, given the request's `tools`."""
    parser = _PARSERS[name]()
    if tools:
        parser.tools = tools
    return parser
