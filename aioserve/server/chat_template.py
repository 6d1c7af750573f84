"""Rendering chat messages into a prompt with the chat template, as vLLM does.

The template is `--chat-template` (a file path, or the template itself) when given, else
the tokenizer's own. Message content arrives as a string or as OpenAI content parts
(`[{"type": "text", "text": ...}]`); only text parts are accepted. What the template gets
depends on `--chat-template-content-format`:

- "string": the text parts joined with newlines (vLLM's rule);
- "openai": the list of parts, `[{"type": "text", "text": ...}]` (string content becomes
  one such part);
- "auto" (default): "openai" when the template loops over a message's content
  (`{% for part in message['content'] %}`), else "string" — vLLM's detection, done on
  the template's Jinja syntax tree.

The rendered text is tokenized without adding special tokens: the template writes them.
"""

from __future__ import annotations

import functools
import os
from http import HTTPStatus
from typing import Any

import jinja2
from jinja2 import nodes

from aioserve.server.body_fields import shown_value
from aioserve.server.errors import APIError, bad_parameter
from aioserve.server.state import ServerState

_CONTENT_FORMATS = ("auto", "string", "openai")
# apply_chat_template's own arguments, which chat_template_kwargs may not override.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "tools",
        "documents",
    }
)


def render_chat(
    state: ServerState,
    messages: list,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and its token ids for `messages`; 400 for anything malformed."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError("chat needs the tokenizer, which is not loaded (--skip-tokenizer-init)")
    if add_generation_prompt and continue_final_message:
        raise APIError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    kwargs = dict(chat_template_kwargs or {})
    for name in kwargs:
        if name in _RESERVED_KWARGS:
            raise bad_parameter(
                "chat_template_kwargs", name, f"chat_template_kwargs may not set `{name}`"
            )
    template = _template(state)
    as_parts = _content_format(state, template) == "openai"
    conversation = [_message(i, m, as_parts) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            **kwargs,
        )
    except (jinja2.TemplateError, ValueError, TypeError) as error:
        raise APIError(f"the chat template could not render the messages: {error}") from None
    return text, tokenizer(text, add_special_tokens=False).input_ids


def load_chat_template(value: str) -> str:
    """`--chat-template`'s value as a template: the file it names, or the value itself."""
    return _load_chat_template(value)


@functools.lru_cache(maxsize=8)
def _load_chat_template(value: str) -> str:
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a template")
    return value


def _template(state: ServerState) -> str:
    configured = state.frontend.chat_template
    if configured:
        try:
            return load_chat_template(configured)
        except (OSError, ValueError) as error:
            raise APIError(
                f"the server's chat template cannot be loaded: {error}",
                HTTPStatus.INTERNAL_SERVER_ERROR,
            ) from None
    template = state.engine.tokenizer.chat_template
    if not template:
        raise APIError(
            "the model has no chat template: start the server with --chat-template",
            param="messages",
        )
    if isinstance(template, dict):  # named templates: the "default" one, as transformers does
        template = template.get("default")
        if template is None:
            raise APIError("the model's chat templates have no default one", param="messages")
    return template


def _content_format(state: ServerState, template: str) -> str:
    chosen = state.frontend.chat_template_content_format
    if chosen not in _CONTENT_FORMATS:
        raise APIError(
            f"unknown --chat-template-content-format {chosen!r}", HTTPStatus.INTERNAL_SERVER_ERROR
        )
    if chosen != "auto":
        return chosen
    return _detect_content_format(template)


@functools.lru_cache(maxsize=8)
def _detect_content_format(template: str) -> str:
    """ "openai" when the template iterates over some value's `content`, else "string"."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return "string"  # rendering will report the error
    for loop in tree.find_all(nodes.For):
        target = loop.iter
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const):
            if target.arg.value == "content":
                return "openai"
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return "openai"
    return "string"


def _message(index: int, message: Any, as_parts: bool) -> dict[str, Any]:
    """One message as the template sees it; content parts checked and converted."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_parameter(where, shown_value(message), "each message must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_parameter(f"{where}.role", shown_value(role), "a message needs a role (a string)")
    content = message.get("content")
    if content is None:
        if role != "assistant":  # OpenAI lets only an assistant message go without content
            raise bad_parameter(
                f"{where}.content", shown_value(content), f"a {role} message needs content"
            )
        return message
    if isinstance(content, str):
        content = [{"type": "text", "text": content}] if as_parts else content
        return {**message, "content": content}
    if not isinstance(content, list):
        raise bad_parameter(
            f"{where}.content",
            shown_value(content),
            "content must be a string or an array of content parts",
        )
    texts = []
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise bad_parameter(part_where, shown_value(part), "a content part must be an object")
        kind = part.get("type")
        if kind != "text":
            raise bad_parameter(
                f"{part_where}.type", shown_value(kind), "only text content parts are supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_parameter(
                f"{part_where}.text", shown_value(text), "a text part needs its text (a string)"
            )
        texts.append(text)
    if as_parts:
        converted: Any = [{"type": "text", "text": text} for text in texts]
    else:
        converted = "\n".join(texts)
    return {**message, "content": converted}
