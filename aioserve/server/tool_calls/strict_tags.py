"""--tool-strict-level: the tool calls of a tool_choice "auto" answer held to the request's
tools by a structural tag, as vLLM 0.32 holds them.

Under "auto" the model may write text, calls, or both; the tag leaves the text free and,
once the model opens a call in its parser's format, lets it name only the request's tools
and (for a strict tool) write only arguments valid under the tool's `parameters`:

- `auto` (the default): a tag only when a tool says `"strict": true`; the strict tools'
  arguments follow their schemas, the others' any JSON.
- `function`: a tag for every request with tools; arguments as under `auto`.
- `parameter`: every tool is held to its schema, as if each said `"strict": true`.

`parallel_tool_calls: false` adds a tag at least at `function`, stopping after the first
call. A request with its own structured output (response_format, ...) gets no tag: its
constraint governs the whole answer. "required" and a named function are forced as
before (tool_calls/forced.py), whatever the level.

A parser takes part through its `structural_form` (vLLM's structural_tag_model): hermes's
form is written here as vLLM writes it; llama3_json, qwen3_coder and deepseek_v3 use
xgrammar's builtin forms ("llama", "qwen_3_coder", "deepseek_r1"). The tag is xgrammar's
form, compiled by xgrammar whatever the server's structured-output backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CALL_LISTS = ("triggered_tags", "token_triggered_tags", "tags_with_separator")


def strict_call_tag(
    form: str | None, tools: Sequence[dict[str, Any]], level: str, single_call: bool
) -> dict[str, Any] | None:
    """The structural tag (xgrammar's form) for a tool_choice "auto" request, or None when
    its calls are left free."""
    if form is None:
        return None
    if single_call and level == "auto":
        level = "function"  # one call only is enforced by the tag
    if level == "auto" and not any(_is_strict(tool) for tool in tools):
        return None
    pinned = [_with_strict(tool, level == "parameter" or _is_strict(tool)) for tool in tools]
    call_list = _hermes_calls(pinned) if form == "hermes" else _builtin_calls(form, pinned)
    if single_call:
        _stop_after_first(call_list)
    return {"type": "structural_tag", "format": call_list}


def _is_strict(tool: dict[str, Any]) -> bool:
    return tool["function"].get("strict") is True


def _with_strict(tool: dict[str, Any], strict: bool) -> dict[str, Any]:
    return {**tool, "function": {**tool["function"], "strict": strict}}


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any] | bool:
    """A strict function's parameters; any JSON for the others (xgrammar reads True so)."""
    if not function["strict"] or function.get("parameters") is None:
        return True
    return function["parameters"]


def _hermes_calls(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with or without the
    newlines Hermes and Qwen templates put inside the tags."""
    layouts = (
        ('<tool_call>\n{"name": "', "}\n</tool_call>"),
        ('<tool_call>{"name": "', "}</tool_call>"),
    )
    tags = [
        {
            "type": "tag",
            "begin": f'{begin}{tool["function"]["name"]}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": _arguments_schema(tool["function"])},
            "end": end,
        }
        for tool in tools
        for begin, end in layouts
    ]
    return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}


def _builtin_calls(form: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    import xgrammar  # only requests that get a tag need it

    tag = xgrammar.get_model_structural_tag(form, tools=tools, tool_choice="auto", reasoning=False)
    return tag.model_dump(mode="json", exclude_none=True)["format"]


def _stop_after_first(node: Any) -> None:
    """Every list of calls in `node` ends after its first call (in place)."""
    if isinstance(node, dict):
        if node.get("type") in _CALL_LISTS:
            node["stop_after_first"] = True
        for value in node.values():
            _stop_after_first(value)
    elif isinstance(node, list):
        for item in node:
            _stop_after_first(item)
