"""A chat request's messages as the chat template sees them, built as vLLM 0.32 builds them.

Each message becomes a new dict holding what vLLM passes on (renderers/chat_utils.py,
`_parse_chat_message_content`): `role` and `content`; an assistant's `tool_calls` and its
`reasoning` (also as `reasoning_content`; either name may be sent); a tool message's
`tool_call_id`; `name` and `task` when strings; a developer message's `tools`. Other keys
are dropped.

Content is a string, a list of parts, or missing (no parts; null too, in an assistant
message: vLLM's request models refuse a null content in any other). Text-like parts are
read as text: `text`, `input_text` and `output_text` (their `text`), `refusal` (its
`refusal`), `thinking` (its `thinking`); a part whose text is null or missing is skipped.
`tool_reference` parts carry a tool's name. `image_url` parts are taken when the model
takes images (an `image_placeholder` is given; chat_images.py reads their URLs): in the
"openai" format each becomes `{"type": "image"}`; in "string" the message's placeholders
its text lacks are put first, a line each (vLLM's _get_full_multimodal_text_prompt). Other
media parts (audio, video, files, embeddings), and images for a text model, are refused. In
the "string" content format the parts' texts are joined with newlines; in "openai" they
stay parts, `{"type": "text", "text": ...}` plus any field of the part vLLM does not know
(`cache_control`, ...), except that a tool message's text parts are still joined into one
string, as vLLM does for templates that expect one.

Then, as vLLM's `_postprocess_messages`: an assistant's past `tool_calls` get their
`function.arguments` parsed from JSON into an object (invalid JSON, or JSON that is not an
object, gives {}), an empty list of calls is dropped, and a call not of type "function" is
a 400. When a `developer` message is sent and the template never names that role, the
developer messages become system messages, and all system messages are merged into one at
the start (vLLM's renderers/hf.py, `_convert_developer_to_system` and
`_consolidate_system_messages`).
"""

from __future__ import annotations

import json
from typing import Any

from aioserve.server.body_fields import shown_value
from aioserve.server.errors import APIError, bad_parameter

# Text-like part types -> the key holding their text (vLLM's TEXT_PART_TYPES, MM_PARSER_MAP).
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_TYPES = frozenset(
    {
        "image_url",
        "input_image",
        "image_pil",
        "image_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "video_embeds",
        "prompt_embeds",
        "file",
    }
)
# The fields of vLLM's content part types: in the "openai" format a text part keeps the
# others (chat_utils.py, _collect_extra_fields).
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_IMAGE: Any = object()  # an image part's place among the parts' texts
_NOT_A_FUNCTION_CALL = "chat completions only support assistant tool_calls of type 'function'."


def conversation(
    messages: list, as_parts: bool, template: str, image_placeholder: str | None = None
) -> list[dict[str, Any]]:
    """The messages the template renders; `as_parts` for the "openai" content format;
    `image_placeholder`, an image model's placeholder text (None: images are refused).
    The request's own dicts are left as they are."""
    converted = [
        _message(i, message, as_parts, image_placeholder) for i, message in enumerate(messages)
    ]
    if any(m["role"] == "developer" for m in converted) and not _names_developer(template):
        converted = _merge_system_messages(
            [_as_system(m) if m["role"] == "developer" else m for m in converted]
        )
    return converted


def content_text(message: dict[str, Any]) -> str:
    """A (checked) request message's content as one string, its parts' texts joined with
    newlines: what vLLM echoes with `echo`."""
    parts = _parts("message", message.get("content"), images=True)
    return "\n".join(text for _, text in parts if text is not _IMAGE)


def _message(
    index: int, message: Any, as_parts: bool, image_placeholder: str | None
) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_parameter(where, shown_value(message), "each message must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise bad_parameter(f"{where}.role", shown_value(role), "a message needs a role (a string)")
    if "content" in message and message["content"] is None and role != "assistant":
        # vLLM's request models let only an assistant's content be null (missing is fine).
        raise bad_parameter(
            f"{where}.content", "None", "content may be null only in an assistant message"
        )
    parts = _parts(where, message.get("content"), images=image_placeholder is not None)
    result: dict[str, Any] = {"role": role}
    if as_parts:
        result["content"] = [part for part, _ in parts]
    else:
        result["content"] = _joined_text(parts, image_placeholder)
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = _tool_calls(where, message["tool_calls"])
            if calls:
                result["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if as_parts and all(part["type"] == "text" for part, _ in parts):
            result["content"] = _joined_text(parts, image_placeholder)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _joined_text(parts: list[tuple[dict[str, Any], str]], image_placeholder: str | None) -> str:
    """A message's content in the "string" format: its texts joined with newlines, after
    a line for each image whose placeholder the texts do not hold already."""
    text = "\n".join(text for _, text in parts if text is not _IMAGE)
    images = sum(text is _IMAGE for _, text in parts)
    if not images:
        return text
    missing = images - text.count(image_placeholder)
    if missing < 0:
        raise APIError(
            f"Found more '{image_placeholder}' placeholders in input prompt than actual "
            "multimodal data items. (parameter=messages)",
            param="messages",
        )
    return "\n".join([image_placeholder] * missing + ([text] if text else []))


def _parts(where: str, content: Any, images: bool = False) -> list[tuple[dict[str, Any], str]]:
    """Each kept part of `content`, as an "openai" part and as its text (_IMAGE for an
    image, taken when `images`)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [({"type": "text", "text": content}, content)]
    if not isinstance(content, list):
        raise bad_parameter(
            f"{where}.content",
            shown_value(content),
            "content must be a string or an array of content parts",
        )
    parts = []
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise bad_parameter(part_where, shown_value(part), "a content part must be an object")
        kind = part.get("type")
        if kind in _TEXT_KEYS:
            key = _TEXT_KEYS[kind]
            text = part.get(key)
            if text is None:
                continue  # vLLM skips a part without its text
            if not isinstance(text, str):
                raise bad_parameter(
                    f"{part_where}.{key}",
                    shown_value(text),
                    f"a {kind} part needs its {key} (a string)",
                )
            extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
            parts.append(({"type": "text", "text": text, **extra}, text))
        elif kind == "tool_reference":
            name = part.get("name")
            if not isinstance(name, str):
                raise bad_parameter(
                    f"{part_where}.name",
                    shown_value(name),
                    "a tool_reference part needs the tool's name (a string)",
                )
            parts.append(({"type": "tool_reference", "name": name}, name))
        elif kind == "image_url" and images:
            parts.append(({"type": "image"}, _IMAGE))
        elif kind in _MEDIA_TYPES:
            raise bad_parameter(
                f"{part_where}.type",
                shown_value(kind),
                f"{kind} content parts need a multimodal model: only text content parts are "
                "supported",
            )
        else:
            raise bad_parameter(
                f"{part_where}.type",
                shown_value(kind),
                "unknown content part type: only text content parts are supported",
            )
    return parts


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """A past assistant turn's calls, their arguments parsed (vLLM's _postprocess_messages)."""
    if not isinstance(calls, list):
        raise bad_parameter(
            f"{where}.tool_calls", shown_value(calls), "tool_calls must be an array"
        )
    parsed = []
    for call in calls:
        if not isinstance(call, dict):
            raise _vllm_error("assistant tool_calls entries must be objects.")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise _vllm_error(_NOT_A_FUNCTION_CALL)
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}  # a malformed call in the history must not fail every later turn
        if not isinstance(arguments, dict):
            arguments = {}
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def _vllm_error(message: str) -> APIError:
    # vLLM's VLLMValidationError(message, parameter="tool_calls"), worded as it prints.
    return APIError(f"{message} (parameter=tool_calls)", param="tool_calls")


def _names_developer(template: str) -> bool:
    """Whether the template handles the developer role itself (vLLM's test: it quotes it)."""
    return '"developer"' in template or "'developer'" in template


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    converted = {**message, "role": "system"}
    converted.pop("tools", None)
    return converted


def _merge_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One system message first, holding every system message's text (blank lines between),
    when there are several or one is not first; otherwise the messages as they are."""
    texts: list[str] = []
    others = []
    merge = False
    for i, message in enumerate(messages):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part if isinstance(part, str) else part["text"]
                for part in content
                if isinstance(part, str) or (isinstance(part, dict) and "text" in part)
            )
        if content:
            texts.append(content)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]
