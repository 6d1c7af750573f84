"""Structural tags: a request's tool calls held to its tools in the parser's own format,
as vLLM 0.32 holds them (parser/abstract_parser.py _apply_structural_tag,
tool_parsers/structural_tag_registry.py).

A parser takes part through its `structural_form` (vLLM's structural_tag_model): hermes's
form is built here as vLLM builds it; llama3_json, qwen3_coder and deepseek_v3 use
xgrammar's builtin forms ("llama", "qwen_3_coder", "deepseek_r1"). The tag is the JSON
vLLM sends (`StructuralTag.model_dump()`), compiled by xgrammar whatever the server's
structured-output backend. With VLLM_ENFORCE_STRICT_TOOL_CALLING other than "true" or "1"
(vLLM's reading; it is on by default) no request gets a tag, as in vLLM.

tool_choice "auto": the model may write text, calls, or both; the tag leaves the text free
and, once the model opens a call, lets it name only the request's tools and (for a strict
tool) write only arguments valid under the tool's `parameters`. --tool-strict-level:

- `auto` (the default): a tag only when a tool says `"strict": true`; the strict tools'
  arguments follow their schemas, the others' any JSON.
- `function`: a tag for every request with tools; arguments as under `auto`.
- `parameter`: every tool is held to its schema, as if each said `"strict": true`.

A request with its own structured output (response_format, ...) gets no "auto" tag: its
constraint governs the whole answer.

tool_choice "required" and a named function (tools.py): the tag is the whole answer, one
call or more of the tools in the parser's format ("required"; hermes and deepseek_v3 from
the first token, llama3_json and qwen3_coder after any text), or one call of the named
tool. Arguments follow the same strictness: a tool that is not strict (at a level below
`parameter`) gets any JSON as its arguments, as in vLLM.

`parallel_tool_calls: false` stops every list of calls after its first (vLLM's
limit_to_single_tool_call); under "auto" it raises the level to at least `function`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

ENFORCE_STRICT_ENV = "VLLM_ENFORCE_STRICT_TOOL_CALLING"


def enforces_strict_tool_calling() -> bool:
    """VLLM_ENFORCE_STRICT_TOOL_CALLING as vLLM's envs.py reads it: on unless set to
    something other than "true" or "1" (any case)."""
    return os.environ.get(ENFORCE_STRICT_ENV, "True").lower() in ("true", "1")


def strict_call_tag(
    form: str | None,
    tools: Sequence[dict[str, Any]],
    level: str,
    single_call: bool,
    tool_choice: str | dict[str, Any] = "auto",
) -> dict[str, Any] | None:
    """The structural tag (vLLM's JSON, xgrammar's form) for a request's tools and
    tool_choice ("auto", "required" or a named function, chat's form), or None when its
    calls are left free. `tools` are checked ones (tools.py checked_tools)."""
    if form is None:
        return None
    auto = tool_choice == "auto"
    if single_call and auto and level == "auto":
        level = "function"  # one call only is enforced by the tag
    if auto and level == "auto" and not any(_is_strict(tool) for tool in tools):
        return None
    pinned = [_xgrammar_tool(tool, level == "parameter" or _is_strict(tool)) for tool in tools]
    choice = tool_choice if isinstance(tool_choice, str) else _named_choice(tool_choice)
    if form == "hermes":
        tag = _hermes_tag(pinned, choice)
    else:
        import xgrammar  # only requests that get a tag need it

        tag = xgrammar.get_model_structural_tag(
            form, tools=pinned, tool_choice=choice, reasoning=False
        )
    if single_call:
        _stop_after_first(tag.format)
    return tag.model_dump()


def _is_strict(tool: dict[str, Any]) -> bool:
    return tool["function"].get("strict") is True


def _xgrammar_tool(tool: dict[str, Any], strict: bool) -> dict[str, Any]:
    """A tool as vLLM hands it to xgrammar: its ChatCompletionToolsParam dumped without
    its None fields, `strict` pinned (structural_tag_registry.py resolve_tool_strictness,
    _dump_tool_for_xgrammar)."""
    function = {k: v for k, v in tool["function"].items() if v is not None}
    dumped = {"type": "function", "function": {**function, "strict": strict}}
    if tool.get("defer_loading") is not None:
        dumped["defer_loading"] = tool["defer_loading"]
    return dumped


def _named_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A named tool_choice as vLLM dumps it for xgrammar."""
    return {"type": "function", "function": {"name": choice["function"]["name"]}}


def _hermes_tag(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> Any:
    """vLLM's hermes tag (structural_tag_registry.py _hermes_style_structural_tag): each
    call `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with or without the
    newlines Hermes and Qwen templates put inside the tags; under "auto" the calls follow
    text, otherwise they are the whole answer."""
    import xgrammar
    from xgrammar.structural_tag import (
        AnyTextFormat,
        JSONSchemaFormat,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    functions, _, simplified = xgrammar.normalize_tool_choice(tools, tool_choice)
    layouts = (
        ('<tool_call>\n{"name": "', "}\n</tool_call>"),
        ('<tool_call>{"name": "', "}</tool_call>"),
    )
    tags = [
        TagFormat(
            begin=f'{begin}{tool.function.name}", "arguments": ',
            content=JSONSchemaFormat(json_schema=_arguments_schema(tool.function)),
            end=end,
        )
        for tool in functions
        for begin, end in layouts
    ]
    if simplified == "auto":
        calls: Any = (
            TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags) if tags else AnyTextFormat()
        )
    else:
        calls = TagsWithSeparatorFormat(
            tags=tags, separator="", at_least_one=True, stop_after_first=simplified == "forced"
        )
    return xgrammar.StructuralTag(format=calls)


def _arguments_schema(function: Any) -> dict[str, Any] | bool:
    """A strict function's parameters; any JSON for the others (xgrammar reads True so)."""
    if function.strict is False or function.parameters is None:
        return True
    return function.parameters


def _stop_after_first(node: Any) -> None:
    """Every list of calls in `node` (an xgrammar format) ends after its first call, in
    place (vLLM's limit_to_single_tool_call)."""
    from pydantic import BaseModel
    from xgrammar.structural_tag import (
        TagsWithSeparatorFormat,
        TokenTriggeredTagsFormat,
        TriggeredTagsFormat,
    )

    if isinstance(node, BaseModel):
        if isinstance(
            node, (TriggeredTagsFormat, TokenTriggeredTagsFormat, TagsWithSeparatorFormat)
        ):
            node.stop_after_first = True
        for name in type(node).model_fields:
            _stop_after_first(getattr(node, name))
    elif isinstance(node, (list, tuple)):
        for item in node:
            _stop_after_first(item)
