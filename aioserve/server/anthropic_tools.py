"""Anthropic's tools and tool_choice in a Messages request, as chat's (vLLM 0.32's
entrypoints/anthropic/serving.py, _convert_tools, _resolve_tools, _convert_tool_choice).

A tool ({name, description, input_schema, strict, defer_loading}; a schema without "type"
is an object's) is chat's function tool, `input_schema` its parameters. The
`tool_addition` / `tool_removal` blocks of system messages change the tools, in order: a
tool added by value is declared (or replaced), one added by reference is no longer
deferred, one removed is left out; a reference to a tool not declared is a 400.
tool_choice auto, any, tool (by name) and none are chat's "auto", "required", the named
function and "none"; `disable_parallel_tool_use` is the opposite of chat's
`parallel_tool_calls`.
"""

from __future__ import annotations

from typing import Any

from aioserve.server.body_fields import shown_value
from aioserve.server.errors import APIError, bad_parameter

TOOL_CHANGES = ("tool_addition", "tool_removal")
"""The block types that change a conversation's tools (in system messages only)."""
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _tool(where: str, tool: Any) -> dict[str, Any]:
    """An Anthropic tool, checked, as chat's function tool."""
    if not isinstance(tool, dict):
        raise bad_parameter(where, shown_value(tool), "a tool must be an object")
    name = tool.get("name")
    if not isinstance(name, str):
        raise bad_parameter(f"{where}.name", shown_value(name), "a tool needs a name (a string)")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_parameter(
            f"{where}.input_schema",
            shown_value(schema),
            "a tool needs an input_schema (an object)",
        )
    for key, kind in (("description", str), ("strict", bool), ("defer_loading", bool)):
        if tool.get(key) is not None and not isinstance(tool[key], kind):
            raise bad_parameter(
                f"{where}.{key}", shown_value(tool[key]), f"{key} must be a {kind.__name__}"
            )
    function = {
        "name": name,
        "description": tool.get("description"),
        "parameters": schema if "type" in schema else {**schema, "type": "object"},
        "strict": tool.get("strict"),
        "defer_loading": tool.get("defer_loading"),
    }
    return {"type": "function", "function": function}


def tool_change(where: str, kind: str, change: Any) -> None:
    """A tool_addition / tool_removal block's `tool`, checked."""
    if change is None:
        raise bad_parameter(f"{where}.tool", "null", f"tool is required for {kind} blocks")
    if not isinstance(change, dict):
        raise bad_parameter(f"{where}.tool", shown_value(change), "tool must be an object")
    if change.get("type") == "tool_reference":
        if not isinstance(change.get("name"), str):
            raise bad_parameter(
                f"{where}.tool.name", shown_value(change.get("name")), "name must be a string"
            )
    elif change.get("type") == "tool_definition" and kind == "tool_addition":
        _tool(f"{where}.tool.definition", change.get("definition"))
    elif kind == "tool_removal":
        raise bad_parameter(
            f"{where}.tool", shown_value(change), "tool_removal only accepts a tool_reference"
        )
    else:
        raise bad_parameter(
            f"{where}.tool.type",
            shown_value(change.get("type")),
            "tool must be a tool_reference or a tool_definition",
        )


def resolved_tools(tools: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Chat's tools: `tools` as the system messages' tool_addition / tool_removal blocks
    leave them at the conversation's end (vLLM's _resolve_tools); None without tools."""
    if tools is not None and not isinstance(tools, list):
        raise bad_parameter("tools", shown_value(tools), "tools must be an array")
    changes = [
        block
        for message in messages
        if isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] in TOOL_CHANGES
    ]
    if tools is None and not changes:
        return None
    by_name = {}
    for i, tool in enumerate(tools or []):
        converted = _tool(f"tools[{i}]", tool)
        by_name[converted["function"]["name"]] = converted
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            by_name[name] = _tool("tool_definition", change["definition"])
        else:
            name = change["name"]
            if name not in by_name:
                raise APIError(
                    f"{block['type']} references tool {name!r}, which is not declared in tools",
                    param="messages",
                )
            if block["type"] == "tool_addition":  # no longer deferred
                by_name[name] = {
                    "type": "function",
                    "function": {**by_name[name]["function"], "defer_loading": None},
                }
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def tool_choice(choice: Any) -> dict[str, Any]:
    """Chat's tool_choice and parallel_tool_calls for an Anthropic tool_choice."""
    if not isinstance(choice, dict):
        raise bad_parameter("tool_choice", shown_value(choice), "tool_choice must be an object")
    kind = choice.get("type")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad_parameter(
            "tool_choice.disable_parallel_tool_use",
            shown_value(disable),
            "disable_parallel_tool_use must be a boolean",
        )
    if kind == "tool":
        name = choice.get("name")
        if not name or not isinstance(name, str):
            raise bad_parameter(
                "tool_choice.name",
                shown_value(name),
                "tool_choice.name is required when type is 'tool'",
            )
        chat_choice: Any = {"type": "function", "function": {"name": name}}
    elif kind in _TOOL_CHOICES:
        chat_choice = _TOOL_CHOICES[kind]
    else:
        raise bad_parameter(
            "tool_choice.type",
            shown_value(kind),
            "tool_choice.type must be auto, any, tool or none",
        )
    return {"tool_choice": chat_choice, "parallel_tool_calls": not disable}
