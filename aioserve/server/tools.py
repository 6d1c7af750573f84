"""`tools` and `tool_choice` in a chat request: what the template gets, and how the
output becomes tool calls.

- "none": plain content, the tools given to the chat template
  (`apply_chat_template(tools=...)`), or left out with --exclude-tools-when-tool-choice-none.
- "auto" (the default when tools are given): with --enable-auto-tool-choice and a
  --tool-call-parser, the output is read by that parser (tool_calls/parsers.py) and a
  call made gives finish_reason "tool_calls"; without them, vLLM's 400. Where
  --tool-strict-level asks, the calls are held to the tools (tool_calls/strict_tags.py).
- "required" and a named function: the output is forced into calls, in one of two ways,
  as vLLM 0.32 chooses (parser/abstract_parser.py):
  - with --enable-auto-tool-choice and a --tool-call-parser whose calls have a structural
    form (hermes, llama3_json, qwen3_coder, deepseek_v3), unless
    VLLM_ENFORCE_STRICT_TOOL_CALLING turns it off: a structural tag holds the output to
    the model's own call format, with only the allowed tool(s) and at least one call
    (tool_calls/strict_tags.py), and that parser reads the calls, whole or streamed, as
    under "auto";
  - otherwise: a JSON schema forces the output into bare JSON (tool_calls/forced.py),
    read by the parsers there.
  Either way "required" finishes with "tool_calls" (after a "stop"), a named function with
  "stop", as in vLLM; a request with its own structured output as well is a 400.

With `parallel_tool_calls: false`, only the first call of an answer is kept, whatever the
tool_choice (vLLM's maybe_filter_parallel_tool_calls), and a structural tag allows one.

The template gets each tool as vLLM's `tool.model_dump()` gives it: `type`, then
`function` with `name`, `description` and `parameters` (null when absent) and `strict`
when given; other keys are dropped. POST /tokenize takes `tools` too (`checked_tools`).
Refusals carry vLLM's " (parameter=...)" suffix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioserve.config.frontend import FrontendConfig
from aioserve.engine.structured_outputs import StructuredOutputsParams
from aioserve.server.body_fields import BodyFields, shown_value
from aioserve.server.errors import APIError, bad_parameter, refusal
from aioserve.server.tool_calls.forced import (
    NamedCallParser,
    RequiredCallsParser,
    parameters_schema,
    required_calls_schema,
)
from aioserve.server.tool_calls.parsers import ToolParser, new_tool_parser
from aioserve.server.tool_calls.strict_tags import enforces_strict_tool_calling, strict_call_tag

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass
class ToolUse:
    """What a chat request's tools and tool_choice ask of the answer."""

    tools: list[dict[str, Any]] | None  # for the chat template
    parser: ToolParser | None = None  # reads the output into calls (None: plain content)
    constraint: StructuredOutputsParams | None = None  # forces the output into calls
    calls_finish_as_tool_calls: bool = True  # finish_reason "tool_calls" once calls are made
    single_call: bool = False  # parallel_tool_calls: false
    call_tag: StructuredOutputsParams | None = None  # holds "auto" calls to the tools


def read_tool_use(fields: BodyFields, frontend: FrontendConfig) -> ToolUse:
    """The request's ToolUse, or a 400 for a tool or tool_choice that is malformed or that
    this server cannot serve."""
    tools = fields.get("tools")
    parallel = fields.get("parallel_tool_calls")
    single = parallel is False
    if tools is not None:
        if not tools:
            raise refusal(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                "tools",
            )
        tools = checked_tools(tools)
    choice = fields.get("tool_choice", "auto" if tools else "none")
    if choice == "none":
        exclude = frontend.exclude_tools_when_tool_choice_none
        return ToolUse(None if tools is None or exclude else tools, single_call=single)
    if tools is None:
        raise refusal("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise refusal(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
            '"required" are supported.',
            "tool_choice",
        )
    named = _named_tool(choice, tools) if isinstance(choice, dict) else None
    auto_tools = frontend.enable_auto_tool_choice and frontend.tool_call_parser
    if choice == "auto" and not auto_tools:
        # vLLM's create_error_response, with no parameter (online_renderer.py)
        raise APIError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    parser = new_tool_parser(frontend.tool_call_parser, tools) if auto_tools else None
    form = parser.structural_form if parser and enforces_strict_tool_calling() else None
    level = frontend.tool_strict_level
    if choice == "auto":
        tag = strict_call_tag(form, tools, level, single)
        return ToolUse(tools, parser, single_call=single, call_tag=_xgrammar_constraint(tag))
    if form is not None:
        # vLLM 0.32: the parser's own format, held by a structural tag.
        tag = strict_call_tag(form, tools, level, single, choice)
        return ToolUse(tools, parser, _xgrammar_constraint(tag), named is None, single)
    if named is not None:
        constraint = StructuredOutputsParams(json=parameters_schema(named))
        parser = NamedCallParser(named["function"]["name"])
        return ToolUse(tools, parser, constraint, False, single)
    try:
        schema = required_calls_schema(tools, parallel)
    except ValueError as error:
        raise APIError(str(error), param="tools") from None
    constraint = StructuredOutputsParams(json=schema)
    return ToolUse(tools, RequiredCallsParser(), constraint, single_call=single)


def _xgrammar_constraint(tag: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """A structural tag as a request's constraint: xgrammar's form, which only xgrammar
    reads."""
    return None if tag is None else StructuredOutputsParams(structural_tag=tag, backend="xgrammar")


def checked_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A request's `tools` (None when absent), every definition checked; a 400 naming the
    first that is malformed."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_parameter("tools", shown_value(tools), "tools must be an array")
    return [_template_tool(_tool(i, tool)) for i, tool in enumerate(tools)]


def _template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A checked tool as vLLM's ChatCompletionToolsParam.model_dump() gives it to the chat
    template (vLLM renderers/online_renderer.py): its keys, in its order, unknown ones
    dropped, and a tool-level `defer_loading` copied into the function when it has none."""
    given = tool["function"]
    defer = tool.get("defer_loading")
    function = {
        "name": given["name"],
        "description": given.get("description"),
        "parameters": given.get("parameters"),
    }
    for key, value in (
        ("strict", given.get("strict")),
        ("defer_loading", given.get("defer_loading", defer)),
    ):
        if value is not None:
            function[key] = value
    dumped: dict[str, Any] = {"type": "function", "function": function}
    if defer is not None:
        dumped["defer_loading"] = defer
    return dumped


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
    kinds = (("description", str), ("parameters", dict), ("strict", bool), ("defer_loading", bool))
    for key, kind in kinds:
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise bad_parameter(
                f"{where}.function.{key}",
                shown_value(function[key]),
                f"`{key}` must be {'an object' if kind is dict else f'a {kind.__name__}'}",
            )
    defer = tool.get("defer_loading")
    if defer is not None and not isinstance(defer, bool):
        raise bad_parameter(
            f"{where}.defer_loading", shown_value(defer), "`defer_loading` must be a bool"
        )
    return tool


def _named_tool(choice: dict[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The tool a named tool_choice names, checked against the tools (vLLM
    chat_completion/protocol.py check_tool_usage, then the named choice's `type`)."""
    function = choice.get("function")
    if not isinstance(function, dict):
        raise refusal(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function",
        )
    if "name" not in function:
        raise refusal(
            f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise refusal(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function.name",
        )
    for tool in tools:
        if tool["function"]["name"] == name:
            break
    else:
        raise refusal(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    kind = choice.get("type", "function")
    if kind != "function":
        # vLLM's ChatCompletionNamedToolChoiceParam.type is Literal["function"].
        raise bad_parameter("tool_choice.type", shown_value(kind), "Input should be 'function'")
    return tool
