"""Rendering chat messages into a prompt with the chat template, as vLLM 0.32 does.

The template is the request's own `chat_template` when it sends one and the server runs with
`--trust-request-chat-template` (without it, vLLM's untrusted-template 400), else
`--chat-template` (a file path, or the template itself) when given, else a trusted request's
`chat_template_kwargs.chat_template`, else the tokenizer's own: vLLM's order. A request's
template is the Jinja text itself (never a file), or the name of one of the tokenizer's
named templates; it renders as `--chat-template` does, with the request's kwargs, in
transformers' sandboxed Jinja environment. The messages become what the template sees as chat_messages.py
describes; their content is a string or a list of OpenAI parts depending on
`--chat-template-content-format`: "string", "openai", or "auto" (default), where the
template's Jinja syntax tree decides, as vLLM's detection does: "openai" when the template
loops over a message's content (`{% for part in message['content'] %}`, through variables
assigned from `messages` or a message, filters, tests, slices, or a macro's parameter that
receives the content), else "string".

The template's variables (`chat_template_kwargs`) are merged as vLLM merges them:
`--default-chat-template-kwargs`, under the request's `chat_template_kwargs`, under what
the request's own fields set (`add_generation_prompt`, `continue_final_message`, and for
chat `documents`, `reasoning_effort`, and `enable_thinking` from the effort unless the
request names it); a value of null or "auto" does not override. Of apply_chat_template's
own arguments given there, `tools` and `documents` are used, `tokenize` and `return_dict`
are ignored, `chat_template` is the template above (untrusted: vLLM's 400; null: ignored),
and `conversation` and `messages` are 400s. Any error the template raises is a 400 carrying
its reason, as vLLM's safe_apply_chat_template answers. The rendered text is tokenized without adding special tokens unless asked: the
template writes them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import jinja2
from jinja2 import nodes

from aioserve.server.body_fields import shown_value
from aioserve.server.chat_messages import conversation
from aioserve.server.errors import APIError, bad_parameter, refusal
from aioserve.server.state import ServerState

_CONTENT_FORMATS = ("auto", "string", "openai")
# apply_chat_template arguments that chat_template_kwargs cannot change: the text is always
# rendered, then tokenized here.
_IGNORED_KWARGS = ("tokenize", "return_dict")
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
"""vLLM's refusal of a request's own chat template (renderers/online_renderer.py)."""
BOTH_GENERATION_FLAGS = (
    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
)
"""vLLM's refusal when a request sets both to true itself (its request models' validator)."""
_GENERATION_FLAGS_CONFLICT = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a new "
    "assistant message instead."
)  # transformers' apply_chat_template, which vLLM reports when add_generation_prompt is
# left at its default (true) and continue_final_message is set


def render_chat(
    state: ServerState,
    messages: list,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    image_placeholder: str | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and its token ids for `messages`; 400 for anything malformed.
    `image_placeholder`: an image model's, where images are taken (chat_messages.py).

    `chat_template_kwargs` are the request's (or already merged by `template_kwargs`: the
    server's defaults are merged under them here, which changes nothing the second time).
    `chat_template` is the request's own template (needs --trust-request-chat-template)."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError("chat needs the tokenizer, which is not loaded (--skip-tokenizer-init)")
    trusted = state.frontend.trust_request_chat_template
    refuse_request_template(chat_template, chat_template_kwargs, trusted=trusted)
    kwargs = template_kwargs(state.frontend.default_chat_template_kwargs, chat_template_kwargs)
    for name in ("conversation", "messages"):
        if name in kwargs:
            raise APIError(
                f"chat_template_kwargs cannot set `{name}`: the request's messages are the "
                "conversation",
                param="chat_template_kwargs",
            )
    for name in _IGNORED_KWARGS:
        kwargs.pop(name, None)
    kwargs_template = kwargs.pop("chat_template", None)
    requested_tools = kwargs.pop("tools", None)
    if requested_tools is not None:  # vLLM: chat_template_kwargs' tools win over `tools`
        tools = requested_tools
    kwargs["add_generation_prompt"] = add_generation_prompt
    kwargs["continue_final_message"] = continue_final_message
    template = _template(state, chat_template, kwargs_template)
    as_parts = _content_format(state, template) == "openai"
    chat = conversation(messages, as_parts, template, image_placeholder)
    if add_generation_prompt and continue_final_message:
        raise APIError(_GENERATION_FLAGS_CONFLICT)
    try:
        text = tokenizer.apply_chat_template(
            chat, chat_template=template, tokenize=False, tools=tools, **kwargs
        )
    except Exception as error:  # vLLM: any error the template raises is a 400
        # vLLM answers with the template's own reason (raise_exception's message, ...).
        raise APIError(_template_error_reason(error)) from None
    return text, tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def template_kwargs(
    defaults: dict[str, Any] | None,
    requested: dict[str, Any] | None,
    *,
    documents: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
) -> dict[str, Any]:
    """The template's variables: `defaults` (--default-chat-template-kwargs), the request's
    `chat_template_kwargs` over them, and the chat request's own `documents` and
    `reasoning_effort` over both, as vLLM merges them (`merge_kwargs`: null and "auto" do
    not override). A reasoning effort also sets `enable_thinking` (effort != "none"),
    unless the request's chat_template_kwargs name it (vLLM's build_chat_params)."""
    # A server default `chat_template` is not a template: vLLM's merge would make it one.
    server = {k: v for k, v in (defaults or {}).items() if k != "chat_template"}
    merged = _merged(server, requested)
    fields: dict[str, Any] = {"documents": documents, "reasoning_effort": reasoning_effort}
    if reasoning_effort is not None and "enable_thinking" not in (requested or {}):
        fields["enable_thinking"] = reasoning_effort != "none"
    return _merged(merged, fields)


def _merged(defaults: dict[str, Any] | None, overrides: dict[str, Any] | None) -> dict[str, Any]:
    merged = dict(defaults or {})
    merged.update((k, v) for k, v in (overrides or {}).items() if not _unset(v))
    return merged


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def refuse_request_template(
    chat_template: Any, chat_template_kwargs: dict[str, Any] | None, *, trusted: bool
) -> None:
    """400 for a chat template sent with the request, as the `chat_template` field or inside
    `chat_template_kwargs`, that is not a string, or that the server does not trust (vLLM's
    message: without --trust-request-chat-template; a null one is let through, as vLLM
    does)."""
    if chat_template is not None and not isinstance(chat_template, str):
        raise bad_parameter(
            "chat_template", shown_value(chat_template), "chat_template must be a string"
        )
    in_kwargs = (chat_template_kwargs or {}).get("chat_template")
    if in_kwargs is not None and not isinstance(in_kwargs, str):
        raise bad_parameter(
            "chat_template_kwargs",
            shown_value(in_kwargs),
            "chat_template_kwargs.chat_template must be a string",
        )
    if not trusted and (chat_template is not None or in_kwargs is not None):
        raise APIError(UNTRUSTED_TEMPLATE)


def refuse_request_mm_kwargs(body: dict[str, Any]) -> None:
    """vLLM's 400 for per-request multimodal kwargs (it needs --trust-request-mm-kwargs,
    which aioserve, serving text models, does not have)."""
    for name, what in (
        ("mm_processor_kwargs", "multimodal preprocessing resource usage"),
        ("media_io_kwargs", "multimodal media loading resource usage"),
    ):
        if body.get(name):
            raise refusal(
                f"Per-request {name} are disabled by default because they can change {what}. "
                "Start the server with --trust-request-mm-kwargs only when clients are "
                "trusted.",
                name,
            )


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


def _template(state: ServerState, requested: str | None, in_kwargs: str | None) -> str:
    """The template to render with, in vLLM's order: the request's `chat_template` (an empty
    one counts as none, as vLLM's `request.chat_template or default`), --chat-template,
    the request's `chat_template_kwargs.chat_template`, the tokenizer's. Requests' templates
    are trusted here (refuse_request_template has run)."""
    if requested:
        return _named_or_literal(state, requested)
    configured = state.frontend.chat_template
    if configured:
        try:
            return load_chat_template(configured)
        except (OSError, ValueError) as error:
            raise APIError(
                f"the server's chat template cannot be loaded: {error}",
                HTTPStatus.INTERNAL_SERVER_ERROR,
            ) from None
    if in_kwargs is not None:
        return _named_or_literal(state, in_kwargs)
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


def _named_or_literal(state: ServerState, template: str) -> str:
    """A request's template: one of the tokenizer's named templates when it names one (as
    transformers' get_chat_template, which vLLM calls), else the Jinja text itself."""
    own = state.engine.tokenizer.chat_template
    if isinstance(own, dict) and template in own:
        return own[template]
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


@functools.lru_cache(maxsize=32)
def _detect_content_format(template: str) -> str:
    """ "openai" when the template loops over a message's content, else "string" (vLLM's
    renderers/hf.py, `_detect_content_format`)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return "string"  # rendering will report the error
    try:
        found = next(_content_loops(tree), None)
    except _Unreadable:
        return "string"
    return "string" if found is None else "openai"


class _Unreadable(Exception):
    """A template whose loops or assignments vLLM's detection cannot follow."""


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    """The loops over a message's content: `message['content']` (or `.content`) of a
    message variable, a macro parameter given it, or a variable named `content`."""
    lists = _message_list_names(tree)
    message_names = [
        _target(loop)
        for loop in tree.find_all(nodes.For)
        if any(_reads(loop.iter, name) for name in lists)
    ]
    content_params: dict[int, set[str]] = {}  # loop in a macro -> the macro's content params
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        params = _content_params(tree, macro, message_names)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                content_params[id(loop)] = params
    for loop in tree.find_all(nodes.For):
        over = loop.iter
        if any(_reads(over, name, "content") for name in message_names):
            yield loop
        elif isinstance(over, nodes.Name) and over.name in content_params.get(id(loop), ()):
            yield loop
        elif id(loop) not in in_macros and isinstance(over, nodes.Name) and over.name == "content":
            yield loop


def _message_list_names(tree: nodes.Template) -> list[str]:
    """`messages` and the variables assigned from it, from those, ... (a slice, a filter
    or a test of one counts)."""
    names = ["messages"]
    pending = ["messages"]
    while pending:
        source = pending.pop(0)
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, source):
                if not isinstance(assign.target, nodes.Name):
                    raise _Unreadable
                names.append(assign.target.name)
                if assign.target.name != source:
                    pending.append(assign.target.name)
    return names


def _content_params(tree: nodes.Template, macro: nodes.Macro, messages: list[str]) -> set[str]:
    """The parameters of `macro` that some call gives a message's content."""
    params = [arg.name for arg in macro.args]
    found = set()
    for call in tree.find_all(nodes.Call):
        if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
            continue
        for i, arg in enumerate(call.args[: len(params)]):
            if any(_reads(arg, name, "content") for name in messages):
                found.add(params[i])
        for keyword in call.kwargs:
            if keyword.key in params and any(
                _reads(keyword.value, name, "content") for name in messages
            ):
                found.add(keyword.key)
    return found


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is the variable `name` (or its item `key`), possibly under filters,
    tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        item = node.arg
        return _is_name(node.node, name) and isinstance(item, nodes.Const) and item.value == key
    return isinstance(node, nodes.Getattr) and node.attr == key and _is_name(node.node, name)


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _target(loop: nodes.For) -> str:
    if not isinstance(loop.target, nodes.Name):
        raise _Unreadable
    return loop.target.name


def _template_error_reason(error: BaseException) -> str:
    """The most specific reason in an error's chain: a Jinja error's own, else the error's."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(error)
