"""tool_choice "required" and a named function forced as bare JSON, and read back.

vLLM 0.32 forces these two in the tool parser's own format when the parser has a
structural form (strict_tags.py; tools.py says when). The older forcing here stays for
the rest, as in vLLM: without --enable-auto-tool-choice and a --tool-call-parser, with a
parser that has no structural form, or with VLLM_ENFORCE_STRICT_TOOL_CALLING=0.

It is a JSON schema enforced by structured outputs, so the output is a valid call of the
given schema every time: a named function's output is its arguments (a JSON object of its
`parameters` schema); "required" makes a JSON array of one or more
`{"name": ..., "parameters": {...}}` objects, each of one of the tools (one at most with
`parallel_tool_calls: false`). The parsers here read those outputs into calls.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from aioserve.server.tool_calls.parsers import (
    CallSoFar,
    ParsedOutput,
    ToolParser,
    calls_in_array,
    reserialised,
    skip_whitespace,
)


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema; a function without one takes an empty object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_calls_schema(tools: list[dict[str, Any]], parallel: bool | None) -> dict[str, Any]:
    """The JSON schema of tool_choice "required"'s output (vLLM's)."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = copy.deepcopy(parameters_schema(tool))
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.get(name, schema) != schema:
                raise ValueError(f"tools define `$defs` {name!r} twice, differently")
            defs[name] = schema
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredCallsParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        if pos >= len(text):
            return ParsedOutput("")
        if text[pos] != "[":
            raise ValueError("the calls of tool_choice required are a JSON array")
        return ParsedOutput("", calls_in_array(text, pos, ("parameters",)))

    def read_whole(self, text: str) -> ParsedOutput:
        # vLLM parser/abstract_parser.py _extract_tool_calls: json.dumps(tc.parameters)
        parsed = self.read(text, final=True)
        for call in parsed.calls:
            call.arguments = reserialised(json.loads(call.arguments))
        return parsed


class NamedCallParser(ToolParser):
    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> ParsedOutput:
        arguments = text.lstrip()
        if final:
            arguments = arguments.rstrip()
        return ParsedOutput("", [CallSoFar(self.function, arguments, complete=final)])
