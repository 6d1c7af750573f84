"""Tool-call formats written as XML-like tags: `qwen3_coder` (Qwen3-Coder).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each value is the text between its tags less one leading and one trailing newline, ended
by `</parameter>` or by the next `<parameter=`, and typed by the request's schema of that
function's parameter (`typed_value`), as vLLM's parser engine does (vllm/parser/qwen3.py,
parser/engine/parser_engine.py `_fix_arg_types`); without one it stays a string. The
arguments are `json.dumps` of the values, sent a parameter at a time as each one ends.
`<function=` without `<tool_call>` starts a call too, and a call cut off at the end of the
output keeps the parameters that ended, as in vLLM. Text before the first call is content
(stripped, in a whole output); when streamed, text after the calls is content too.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aioserve.server.tool_calls.parsers import (
    CallSoFar,
    ParsedOutput,
    ToolParser,
    content_until,
    register_tool_parser,
    skip_whitespace,
)

_PARAMETER = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
    re.DOTALL,
)
# vLLM's spellings of JSON Schema types (tool_parsers/utils.py _TYPE_ALIASES).
_TYPE_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_TYPES = (
    (bool, "boolean"),  # before int: a bool is an int
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)
_NOT_JSON = object()


@register_tool_parser("qwen3_coder")
class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    structural_form = "qwen_3_coder"
    skip_special_tokens = False
    call_start, call_end = "<tool_call>", "</tool_call>"
    function_start, function_end = "<function=", "</function>"

    def read_whole(self, text: str) -> ParsedOutput:
        parsed = self.read(text, final=True)
        if parsed.has_calls:
            parsed.content = content_until(text, self._openers, True)[0].strip()
        return parsed

    @property
    def _openers(self) -> tuple[str, str]:
        return self.call_start, self.function_start

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self._openers, final)
        parsed = ParsedOutput(content)
        pos = start
        while pos >= 0:
            after_calls = pos
            pos = skip_whitespace(text, pos)
            if text.startswith(self.call_start, pos):
                pos = skip_whitespace(text, pos + len(self.call_start))
            rest = text[pos:]
            if not rest or (not final and any(opener.startswith(rest) for opener in self._openers)):
                break
            if not rest.startswith(self.function_start):
                if not parsed.calls:
                    raise ValueError("<tool_call> is followed by <function=NAME>")
                parsed.content += text[after_calls:]
                break
            call, pos = self._call(text, pos + len(self.function_start), final)
            if call is None:
                break
            parsed.calls.append(call)
        return parsed

    def _call(self, text: str, pos: int, final: bool) -> tuple[CallSoFar | None, int]:
        """The call whose name starts at `pos` (None until the name is whole) and the index
        after it, its `</tool_call>` included (-1 while the call is unfinished)."""
        name_end = text.find(">", pos)
        if name_end < 0:
            if final:
                raise ValueError("a function's name is not closed")
            return None, -1
        name = text[pos:name_end].strip()
        body_end = text.find(self.function_end, name_end)
        body = text[name_end + 1 : body_end if body_end >= 0 else len(text)]
        properties = _properties(self.tools, name)
        members = [
            f"{json.dumps(key, ensure_ascii=False)}: "
            + json.dumps(typed_value(_trimmed(value), properties.get(key)), ensure_ascii=False)
            for key, value in _PARAMETER.findall(body)
        ]
        complete = body_end >= 0 or final
        arguments = "{" + ", ".join(members) + ("}" if complete else "")
        if body_end < 0:
            return CallSoFar(name, arguments, complete), -1
        end = body_end + len(self.function_end)
        call = CallSoFar(name, arguments, complete=True)
        closing = skip_whitespace(text, end)
        if text.startswith(self.call_end, closing):
            return call, closing + len(self.call_end)
        if not final and self.call_end.startswith(text[closing:]):
            return call, -1  # its </tool_call> may still come
        return call, end


def typed_value(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type, as vLLM coerces it
    (tool_parsers/utils.py coerce_to_schema_type): the first of null, integer, number,
    boolean, object, array, string that the schema allows and the text reads as; a text
    that reads as none stays a string, or its JSON value when that is one."""
    if not isinstance(schema, dict):
        return value
    names = (kind.strip().lower() for kind in _types(schema))
    types = {_TYPE_ALIASES.get(kind, kind) for kind in names}
    for kind in _TYPE_PRIORITY:
        if kind not in types:
            continue
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind in ("object", "array"):
            parsed = _finite_json(value)
            if parsed is not _NOT_JSON:
                return parsed
    parsed = _finite_json(value)
    return value if parsed is _NOT_JSON else parsed


def _types(schema: dict[str, Any]) -> set[str]:
    """The type names a JSON schema allows (`type`, `enum` values, and those of its
    anyOf/oneOf/allOf), "string" when it names none (vLLM's extract_types_from_schema)."""
    kinds: set[str] = set()
    given = schema.get("type")
    if isinstance(given, str):
        kinds.add(given)
    elif isinstance(given, list):
        kinds.update(kind for kind in given if isinstance(kind, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        kinds.update(_enum_type(value) for value in enum)
    for combined in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(combined)
        if isinstance(choices, list):
            for choice in choices:
                kinds |= _types(choice) if isinstance(choice, dict) else {"string"}
    return kinds or {"string"}


def _enum_type(value: Any) -> str:
    if value is None:
        return "null"
    return next((kind for cls, kind in _ENUM_TYPES if isinstance(value, cls)), "string")


def _finite_json(text: str) -> Any:
    """The JSON value of `text`, or _NOT_JSON if it is not JSON or holds an infinite
    number (which would not serialise back to JSON)."""
    try:
        value = json.loads(text)
    except ValueError:
        return _NOT_JSON
    return value if _is_finite(value) else _NOT_JSON


def _is_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_is_finite(item) for item in value.values())
    return True


def _properties(tools: Any, name: str) -> dict[str, Any]:
    """The parameter schemas of the request's function `name` ({} if it has none)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _trimmed(value: str) -> str:
    """A value less the template's newline on each side."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")
