"""The chat messages of a Responses API request: `instructions`, then the `input` items.

As vLLM 0.32 builds them (entrypoints/openai/responses/utils.py): `instructions` (unless
empty) is a system message; a string `input` is a user message; message items keep their
role and their content (a string, or input_text/output_text parts; an assistant's first
part only); a function_call joins the assistant message before it as one of its
tool_calls; a reasoning item is the assistant's `reasoning` (its content's first text,
else its summary's; encrypted content is refused); an assistant message without content
takes the next assistant text; a function_call_output is a tool message. Images, files
and audio are refused as vLLM refuses them for a text model, and other item types by name.
"""

from __future__ import annotations

from typing import Any

from aioserve.server.body_fields import shown_value
from aioserve.server.errors import APIError, bad_parameter, refusal

_PART_TYPES = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


def input_messages(
    body: dict[str, Any], model_name: str, takes_images: bool = False
) -> list[dict[str, Any]]:
    """`instructions` as a system message, then the `input` items as chat messages; an
    `input_image` part becomes chat's `image_url` part where the model `takes_images`."""
    messages = []
    instructions = body.get("instructions")
    if instructions:  # vLLM skips an empty one (the template's default system prompt stays)
        if not isinstance(instructions, str):
            raise bad_parameter(
                "instructions", shown_value(instructions), "instructions must be a string"
            )
        messages.append({"role": "system", "content": instructions})
    if "input" not in body:
        raise APIError("the field `input` is required", param="input")
    items = body["input"]
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_parameter("input", shown_value(items), "input must be a string or an array")
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]", model_name, takes_images)
    if not messages:
        raise APIError(
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
            param="input",
        )
    return messages


def _add_item(
    messages: list[dict[str, Any]], item: Any, where: str, model_name: str, takes_images: bool
) -> None:
    """Append an input item to the chat messages as vLLM does: a function call joins the
    assistant message before it (its tool_calls), an assistant message without content
    takes the next assistant text, a function call's output is a tool message."""
    if not isinstance(item, dict):
        raise bad_parameter(where, shown_value(item), f"{where} must be an object")
    kind = item.get("type", "message")
    previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise bad_parameter(
                    f"{where}.{key}", shown_value(item.get(key)), f"{key} must be a string"
                )
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):  # input_text parts (vLLM takes them too)
            output = _text_parts(output, f"{where}.output", model_name)
        if not isinstance(output, str | list) or not isinstance(item.get("call_id"), str):
            raise bad_parameter(
                where, shown_value(item), "a function_call_output needs a call_id and an output"
            )
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        return
    if kind == "reasoning":
        _add_reasoning(messages, previous, item, where)
        return
    if kind != "message":
        raise bad_parameter(
            f"{where}.type",
            shown_value(kind),
            f"input items of type {kind!r} are not supported yet",
        )
    message = _message(item, where, model_name, takes_images)
    if message["role"] == "assistant" and previous is not None and previous.get("content") is None:
        previous["content"] = message["content"]
        return
    messages.append(message)


def _add_reasoning(
    messages: list[dict[str, Any]], previous: dict[str, Any] | None, item: dict, where: str
) -> None:
    """A reasoning item as the assistant's `reasoning` (vLLM's: its content's first text,
    else its summary's), joining the assistant message before it when that has none."""
    if item.get("encrypted_content") is not None:
        raise refusal("Encrypted content is not supported.", "input")
    texts = [
        part.get("text")
        for key in ("content", "summary")
        for part in (item.get(key) or [])[:1]
        if isinstance(part, dict)
    ]
    reasoning = texts[0] if texts else ""
    if not isinstance(reasoning, str):
        raise bad_parameter(where, shown_value(item), "a reasoning item's text must be a string")
    if previous is not None and previous.get("reasoning") is None:
        previous["reasoning"] = reasoning
    else:
        messages.append({"role": "assistant", "content": None, "reasoning": reasoning})


def _message(
    item: dict[str, Any], where: str, model_name: str, takes_images: bool = False
) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_parameter(
            f"{where}.role", shown_value(role), f"role must be one of {', '.join(_ROLES)}"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_parameter(
            f"{where}.content", shown_value(content), "content must be a string or an array"
        )
    if role == "assistant" and content:
        content = content[:1]  # vLLM keeps an assistant message's first part only
    parts = _text_parts(content, f"{where}.content", model_name, takes_images)
    return {"role": role, "content": parts}


def _text_parts(
    content: list, where: str, model_name: str, takes_images: bool = False
) -> list[dict[str, Any]]:
    """Text parts in chat's form, and images where the model `takes_images`; 400 for
    other media (as vLLM's for a text model) and others."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and takes_images:
            parts.append(_image_part(part, f"{where}[{j}]"))
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise APIError(f"{model_name} is not a multimodal model")  # vLLM's words
        if kind not in _PART_TYPES or not isinstance(part.get("text"), str):
            raise bad_parameter(
                f"{where}[{j}]",
                shown_value(part),
                f"content parts must be {', '.join(_PART_TYPES)} with a string `text`",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An input_image part as chat's image_url part (its URL: a data, http(s) or file URL)."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad_parameter(
            f"{where}.image_url",
            shown_value(url),
            "an input_image needs its image_url (a file_id is not supported by aioserve)",
        )
    return {"type": "image_url", "image_url": {"url": url}}
