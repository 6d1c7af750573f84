"""`tools` and `tool_choice` in a chat request, checked as vLLM 0.32 checks them.

aioserve has no tool-call parser yet (--tool-call-parser is refused at start), so it
serves what vLLM serves without one. A request whose tool_choice is "none" is answered as
plain content, its tools given to the chat template (`apply_chat_template(tools=...)`),
or left out with --exclude-tools-when-tool-choice-none. "auto" (the default when tools
are given), "required" and a named function need a parser to turn the output into calls:
400s with vLLM's messages. History messages with `tool_calls`, and `tool` messages, go to
the template as they are. POST /tokenize takes `tools` too (`checked_tools`), as vLLM's.
"""

from __future__ import annotations

from typing import Any

from aioserve.server.body_fields import BodyFields, shown_value
from aioserve.server.errors import APIError, bad_parameter

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_NO_PARSER = "tool call parsers are not supported by aioserve yet"


def template_tools(fields: BodyFields, exclude_when_none: bool) -> list[dict[str, Any]] | None:
    """The tools the chat template gets (None: none), or a 400 for a tool or a tool_choice
    that is malformed or that needs a tool-call parser."""
    tools = fields.get("tools")
    fields.get("parallel_tool_calls")  # checked; without a parser there are no calls to split
    if tools is not None:
        if not tools:
            raise APIError(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                param="tools",
            )
        tools = checked_tools(tools)
    choice = fields.get("tool_choice", "auto" if tools else "none")
    if choice == "none":
        return None if tools is None or exclude_when_none else tools
    if tools is None:
        raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, dict):
        name = _named_function(choice, tools)
        raise APIError(
            f'tool_choice=function "{name}" requires --tool-call-parser to be set ({_NO_PARSER})',
            param="tool_choice",
        )
    if choice == "auto":
        raise APIError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            f"be set ({_NO_PARSER})",
            param="tool_choice",
        )
    if choice == "required":
        raise APIError(
            f'tool_choice="required" requires --tool-call-parser to be set ({_NO_PARSER})',
            param="tool_choice",
        )
    raise bad_parameter(
        "tool_choice",
        shown_value(choice),
        f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
        '"required" are supported.',
    )


def checked_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A request's `tools` (None when absent), every definition checked; a 400 naming the
    first that is malformed."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_parameter("tools", shown_value(tools), "tools must be an array")
    return [_tool(i, tool) for i, tool in enumerate(tools)]


def _tool(index: int, tool: Any) -> dict[str, Any]:
    """One tool definition, checked: {"type": "function", "function": {"name": ..., ...}}."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_parameter(where, shown_value(tool), "each tool must be an object")
    if tool.get("type", "function") != "function":
        raise bad_parameter(
            f"{where}.type", shown_value(tool["type"]), 'the only tool type is "function"'
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_parameter(
            f"{where}.function", shown_value(function), "a tool needs a `function` object"
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_parameter(
            f"{where}.function.name", shown_value(name), "a function needs a name (a string)"
        )
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise bad_parameter(
                f"{where}.function.{key}",
                shown_value(function[key]),
                f"`{key}` must be {'an object' if kind is dict else f'a {kind.__name__}'}",
            )
    return {**tool, "type": "function"}


def _named_function(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    """The name of a named tool_choice, checked against the tools."""
    function = choice.get("function")
    if not isinstance(function, dict):
        raise APIError(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}",
            param="tool_choice.function",
        )
    if "name" not in function:
        raise APIError(
            f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}",
            param="tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise APIError(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}",
            param="tool_choice.function.name",
        )
    if all(tool["function"]["name"] != name for tool in tools):
        raise APIError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )
    return name
