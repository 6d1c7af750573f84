"""The chat completions body that runs an Anthropic Messages request, built as vLLM 0.32
builds it (entrypoints/anthropic/serving.py, to_chat_completion_request).

- `system` (a string, or text blocks joined with no separator) is one leading system
  message; text blocks starting "x-anthropic-billing-header" (Claude Code's per-request
  header) are left out. A `messages` entry with role "system" stays where it is, unless
  the chat template only takes a leading system message (anthropic_api.py probes it), when
  its text joins the leading one.
- A message's string content stays a string; its blocks become: text blocks a part each
  (one text part alone: a string), `thinking` the assistant's `reasoning`,
  `redacted_thinking` and a message's own `tool_reference` blocks nothing (as vLLM),
  `tool_use` (assistant messages only) a tool call whose arguments are its `input` as
  JSON, and `tool_result` in a user message a tool message before it (its text blocks
  joined with newlines; its `tool_reference` blocks a second tool message of
  tool_reference parts), in an assistant message the text "Tool result: <content>".
  `is_error` is checked and, as in vLLM, reaches no template. A user message left with
  nothing is dropped.
- `tools` and `tool_choice` are chat's (anthropic_tools.py); tools without a tool_choice
  are "auto".
- `max_tokens` (required, positive), `stop_sequences` (at most VLLM_MAX_STOP_STRINGS, 4),
  `temperature`, `top_p`, `top_k` and `stream` (with usage in every chunk) are chat's;
  `output_config.format` (a JSON schema) is chat's response_format, `output_config.effort`
  its reasoning_effort; `thinking` "disabled" sets the reasoning_effort the handler found
  for it, "enabled" chat's thinking_token_budget (its budget_tokens), "adaptive" nothing;
  `metadata` is checked and otherwise unused. vLLM's own
  extras (`cache_salt`, `chat_template_kwargs`, `vllm_xargs`, `watermarking`,
  `kv_transfer_params`, `ec_transfer_params`, `mm_payload`, `return_mm_kwargs`) go along
  to chat, which refuses those aioserve does not serve.

Image blocks become chat's image_url parts (a base64 source as a data URL, a url source's
URL, as vLLM converts them) when the model takes images, and are refused by name when it
does not. Refused, by name: tool_result content other than text and tool_reference blocks
(images in tool results among them). Every wrong type or value is a 400 naming the field.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from aioserve.server.anthropic_tools import TOOL_CHANGES, resolved_tools, tool_change, tool_choice
from aioserve.server.body_fields import shown_value
from aioserve.server.errors import APIError, bad_parameter

MESSAGES_FIELDS: frozenset[str] = frozenset(
    {
        "model", "messages", "max_tokens", "metadata", "output_config", "thinking",
        "stop_sequences", "stream", "system", "temperature", "tool_choice", "tools", "top_k",
        "top_p", "mm_payload", "return_mm_kwargs", "cache_salt", "watermarking",
        "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "chat_template_kwargs",
    }
)  # fmt: skip
"""vLLM 0.32's AnthropicMessagesRequest fields (the others are logged as ignored)."""
COUNT_TOKENS_FIELDS: frozenset[str] = frozenset(
    {
        "model", "messages", "output_config", "system", "thinking", "tool_choice", "tools",
        "chat_template_kwargs",
    }
)  # fmt: skip
"""vLLM 0.32's AnthropicCountTokensRequest fields."""
# vLLM-only fields passed to chat as they are (chat refuses what aioserve does not serve).
_PASSED_ON = (
    "cache_salt", "chat_template_kwargs", "vllm_xargs", "watermarking", "kv_transfer_params",
    "ec_transfer_params", "mm_payload", "return_mm_kwargs",
)  # fmt: skip
_ROLES = ("user", "assistant", "system")
_BLOCK_TYPES = (
    "text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
    "redacted_thinking", "tool_addition", "tool_removal",
)  # fmt: skip
EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""Anthropic's `output_config.effort` values (vLLM's AnthropicEffort)."""
_THINKING_DISPLAYS = ("summarized", "omitted", "updates")
_BILLING_HEADER = "x-anthropic-billing-header"
_FIELD_TYPES = {
    "text": str, "source": dict, "id": str, "tool_use_id": str, "name": str, "input": dict,
    "is_error": bool, "tool_name": str, "thinking": str, "signature": str, "data": str,
}  # fmt: skip


def messages_chat_body(
    body: dict[str, Any],
    model_name: str,
    *,
    merge_inline_system: bool,
    disabled_thinking_effort: str = "none",
    count_only: bool = False,
    takes_images: bool = False,
) -> dict[str, Any]:
    """The chat completions body for a /v1/messages body (`count_only`: a
    /v1/messages/count_tokens body, whose prompt alone matters); a 400 for anything vLLM's
    request model refuses or aioserve cannot serve. `disabled_thinking_effort`: the
    reasoning_effort of `thinking: {"type": "disabled"}`."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_parameter("model", shown_value(model), "model is required (a string)")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_parameter("messages", shown_value(messages), "messages must be an array")
    checked = [_message(i, message) for i, message in enumerate(messages)]
    chat: dict[str, Any] = {
        "model": model,
        "messages": _chat_messages(
            body.get("system"), checked, model_name, merge_inline_system, takes_images
        ),
    }
    if not count_only:
        _sampling_fields(body, chat)
    _output_config(body.get("output_config"), chat)
    _thinking(body, chat, disabled_thinking_effort, count_only)
    tools = resolved_tools(body.get("tools"), checked)
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(tool_choice(choice))
    if tools is not None:
        chat["tools"] = tools
        chat.setdefault("tool_choice", "auto")
    passed_on = ("chat_template_kwargs",) if count_only else _PASSED_ON
    chat.update((name, body[name]) for name in passed_on if name in body)
    return chat


def _sampling_fields(body: dict[str, Any], chat: dict[str, Any]) -> None:
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise APIError("the field `max_tokens` is required", param="max_tokens")
    if not _is_int(max_tokens):
        raise bad_parameter("max_tokens", shown_value(max_tokens), "max_tokens must be an integer")
    if max_tokens <= 0:
        raise bad_parameter("max_tokens", max_tokens, "max_tokens must be positive")
    chat["max_tokens"] = max_tokens
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_parameter(
                "stop_sequences", shown_value(stops), "stop_sequences must be an array of strings"
            )
        limit = int(os.environ.get("VLLM_MAX_STOP_STRINGS", "4"))
        if len(stops) > limit:
            raise bad_parameter(
                "stop_sequences",
                shown_value(stops),
                f"stop_sequences can hold at most {limit} strings (VLLM_MAX_STOP_STRINGS)",
            )
        chat["stop"] = stops
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]  # chat checks their types and ranges
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_parameter("metadata", shown_value(metadata), "metadata must be an object")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_parameter("stream", shown_value(stream), "stream must be a boolean")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}


def _message(index: int, message: Any) -> dict[str, Any]:
    """A `messages` entry, checked: its role, and its content's blocks."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_parameter(where, shown_value(message), "a message must be an object")
    role = message.get("role")
    if role not in _ROLES:
        raise bad_parameter(
            f"{where}.role", shown_value(role), f"role must be one of {', '.join(_ROLES)}"
        )
    content = message.get("content")
    if isinstance(content, list):
        for j, block in enumerate(content):
            _check_block(f"{where}.content[{j}]", block, role)
    elif not isinstance(content, str):
        raise bad_parameter(
            f"{where}.content", shown_value(content), "content must be a string or an array"
        )
    return {"where": where, "role": role, "content": content}


def _check_block(where: str, block: Any, role: str | None) -> None:
    """A content block's type and the types of its fields; tool_addition and tool_removal
    only in system messages (`role` None: the top-level `system`), as vLLM's model says."""
    if not isinstance(block, dict):
        raise bad_parameter(where, shown_value(block), "a content block must be an object")
    kind = block.get("type")
    if kind not in _BLOCK_TYPES:
        raise bad_parameter(
            f"{where}.type",
            shown_value(kind),
            f"content block type must be one of {', '.join(_BLOCK_TYPES)}",
        )
    for key, kind_of in _FIELD_TYPES.items():
        if block.get(key) is not None and not isinstance(block[key], kind_of):
            name = kind_of.__name__
            raise bad_parameter(
                f"{where}.{key}", shown_value(block[key]), f"{key} must be a {name}"
            )
    content = block.get("content")
    if content is not None and not (
        isinstance(content, str)
        or (isinstance(content, list) and all(isinstance(c, dict) for c in content))
    ):
        raise bad_parameter(
            f"{where}.content", shown_value(content), "content must be a string or an array"
        )
    if kind in TOOL_CHANGES:
        if role != "system":
            raise bad_parameter(
                f"{where}.type",
                kind,
                f'{kind} blocks are only allowed in messages with role "system"',
            )
        tool_change(where, kind, block.get("tool"))
    elif kind == "tool_use" and role != "assistant":
        raise bad_parameter(
            f"{where}.type", kind, "tool_use blocks are only allowed in assistant messages"
        )


def _chat_messages(
    system: Any,
    messages: list[dict[str, Any]],
    model_name: str,
    merge_inline_system: bool,
    takes_images: bool = False,
) -> list[dict[str, Any]]:
    """The chat messages: the system prompt, then each message's."""
    chat: list[dict[str, Any]] = []
    system_parts = _system_texts(system)
    if merge_inline_system:
        system_parts += [
            text
            for message in messages
            if message["role"] == "system" and (text := _system_text(message))
        ]
    if system_parts:
        chat.append({"role": "system", "content": "".join(system_parts)})
    for message in messages:
        if message["role"] == "system":
            if not merge_inline_system and (text := _system_text(message)):
                chat.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": message["role"]}
        content = message["content"]
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(message, converted, chat, model_name, takes_images)
        if message["role"] != "user" or "content" in converted:
            chat.append(converted)
    return chat


def _system_texts(system: Any) -> list[str]:
    """The top-level `system`'s texts (a string, or text blocks)."""
    if not system:
        return []
    if isinstance(system, str):
        return [system]
    if not isinstance(system, list):
        raise bad_parameter("system", shown_value(system), "system must be a string or an array")
    texts = []
    for j, block in enumerate(system):
        where = f"system[{j}]"
        _check_block(where, block, None)
        if block["type"] != "text":
            raise bad_parameter(f"{where}.type", block["type"], "system blocks must be text blocks")
        text = block.get("text")
        if text and not text.startswith(_BILLING_HEADER):
            texts.append(text)
    return texts


def _system_text(message: dict[str, Any]) -> str | None:
    """A system message's text (its text blocks joined), billing headers left out."""
    content = message["content"]
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    texts = []
    for j, block in enumerate(content):
        if block["type"] in TOOL_CHANGES:
            continue  # they change the tools (anthropic_tools.py)
        if block["type"] != "text":
            raise bad_parameter(
                f"{message['where']}.content[{j}].type",
                block["type"],
                "a system message's blocks must be text, tool_addition or tool_removal blocks",
            )
        text = block.get("text")
        if text and not text.startswith(_BILLING_HEADER):
            texts.append(text)
    return "".join(texts) if texts else None


def _convert_blocks(
    message: dict[str, Any],
    converted: dict[str, Any],
    chat: list[dict],
    model_name: str,
    takes_images: bool = False,
) -> None:
    """A user or assistant message's blocks into `converted` (tool results of a user
    message are appended to `chat` before it)."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(message["content"]):
        where = f"{message['where']}.content[{j}]"
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and takes_images:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(where, block)}})
        elif kind == "image":
            raise _image_refused(where, model_name)
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if message["role"] == "user":
                chat += _tool_messages(where, block, model_name)
            else:  # vLLM writes the result's content as Python shows it
                result = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
        # redacted_thinking, and tool_reference outside a tool_result: nothing (vLLM's)
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if len(parts) == 1:
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _tool_messages(where: str, block: dict[str, Any], model_name: str) -> list[dict[str, Any]]:
    """A user's tool_result as tool messages: its text, then its tool references."""
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    texts: list[str] = []
    references: list[dict[str, str]] = []
    if isinstance(content, str):
        texts.append(content)
    for k, item in enumerate(content if isinstance(content, list) else []):
        item_where = f"{where}.content[{k}]"
        kind = item.get("type")
        if kind == "text":
            text = item.get("text", "")
            if not isinstance(text, str):
                raise bad_parameter(
                    f"{item_where}.text", shown_value(text), "text must be a string"
                )
            texts.append(text)
        elif kind == "image":
            raise _image_refused(item_where, model_name)
        elif kind == "tool_reference":
            name = item.get("tool_name") or item.get("name")
            if name is not None and not isinstance(name, str):
                raise bad_parameter(
                    f"{item_where}.tool_name", shown_value(name), "tool_name must be a string"
                )
            if name:
                references.append({"type": "tool_reference", "name": name})
        else:
            raise bad_parameter(
                f"{item_where}.type",
                shown_value(kind),
                "a tool_result's content blocks must be text or tool_reference blocks",
            )
    tool_messages = [{"role": "tool", "tool_call_id": call_id, "content": "\n".join(texts)}]
    if references:
        tool_messages.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return tool_messages


def _image_url(where: str, block: dict[str, Any]) -> str:
    """An image block's source as a URL, as vLLM converts it: a url source's URL, else a
    base64 data URL of its media type (image/jpeg when it names none)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_parameter(f"{where}.source", shown_value(source), "an image block needs a source")
    if source.get("type") == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise bad_parameter(f"{where}.source.url", shown_value(url), "url must be a string")
        return url
    data = source.get("data")
    if not isinstance(data, str):
        raise bad_parameter(f"{where}.source.data", shown_value(data), "data must be a string")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{data}"


def _image_refused(where: str, model_name: str) -> APIError:
    return bad_parameter(
        f"{where}.type",
        "image",
        f"image content blocks need a multimodal model, and {model_name} is not a multimodal model",
    )


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    """`output_config`: its JSON schema format as chat's response_format, its effort as
    chat's reasoning_effort."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise bad_parameter("output_config", shown_value(config), "output_config must be an object")
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type", "json_schema") != "json_schema":
            raise bad_parameter(
                "output_config.format",
                shown_value(fmt),
                'output_config.format must be {"type": "json_schema", "schema": {...}}',
            )
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise bad_parameter(
                "output_config.format.schema", shown_value(schema), "schema must be an object"
            )
        if schema:
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"schema": schema, "name": "json_schema"},
            }
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_parameter(
                "output_config.effort",
                shown_value(effort),
                f"output_config.effort must be one of {', '.join(EFFORTS)}",
            )
        chat["reasoning_effort"] = effort


def thinking_type(body: dict[str, Any]) -> str | None:
    """The request's `thinking.type`, if it is an object with a string type."""
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    return kind if isinstance(kind, str) else None


def _thinking(
    body: dict[str, Any], chat: dict[str, Any], disabled_effort: str, count_only: bool
) -> None:
    """`thinking`: "disabled" sets chat's reasoning_effort (over output_config's effort),
    "adaptive" nothing; "enabled" sets chat's thinking_token_budget to its budget_tokens
    (refused there unless reasoning is configured, as vLLM refuses it)."""
    thinking = body.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict):
        raise bad_parameter("thinking", shown_value(thinking), "thinking must be an object")
    kind = thinking.get("type")
    display = thinking.get("display")
    if kind in ("enabled", "adaptive") and display is not None:
        if display not in _THINKING_DISPLAYS:  # vLLM accepts it and always sends reasoning
            raise bad_parameter(
                "thinking.display",
                shown_value(display),
                f"thinking.display must be one of {', '.join(_THINKING_DISPLAYS)}",
            )
    if kind == "disabled":
        chat["reasoning_effort"] = disabled_effort
    elif kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not _is_int(budget) or budget < 1024:
            raise bad_parameter(
                "thinking.budget_tokens",
                shown_value(budget),
                "thinking.budget_tokens must be an integer of at least 1024",
            )
        if not count_only and budget >= chat["max_tokens"]:
            raise bad_parameter(
                "thinking.budget_tokens",
                budget,
                "thinking.budget_tokens must be less than max_tokens",
            )
        chat["thinking_token_budget"] = budget
    elif kind != "adaptive":
        raise bad_parameter(
            "thinking.type",
            shown_value(kind),
            "thinking.type must be enabled, disabled or adaptive",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
