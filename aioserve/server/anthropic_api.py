"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, as vLLM
0.32 serves it (entrypoints/anthropic/), for Anthropic clients (the `anthropic` SDK,
Claude Code-style tools).

A Messages request is translated into a chat completion (anthropic_request.py) and run as
chat runs one: the same template, tokens, sampling, tool parsing and reasoning split. The
chat completion then becomes a message: id and model are chat's (`chatcmpl-...`, as
vLLM's), content blocks thinking (the reasoning, with a random signature), text, and a
tool_use block per call (its `input` the call's arguments decoded), a single empty text
block when there is nothing; stop_reason and usage as anthropic_stream.py describes;
`stop_sequence` and a null `stop_reason` are left out, as vLLM leaves out every null. A
stream is chat's chunks turned into Anthropic's named SSE events (anthropic_stream.py).
count_tokens renders the same prompt and answers `{"input_tokens": n,
"context_management": {"original_input_tokens": n}}`.

Two things are found once per server, by rendering with the chat template, as vLLM finds
them: whether it takes only a leading system message (then `messages` entries with role
"system" join the leading one, with vLLM's warning), and what reasoning_effort
`thinking: {"type": "disabled"}` means ("none", unless the template refuses it or renders
it as one of the thinking efforts: then "low"; vLLM's --anthropic-disabled-thinking-effort
auto).

Every error on these routes is in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with its status and aioserve's error type (BadRequestError, NotFoundError,
...: vLLM's). vLLM answers its request model's validation errors (a missing max_tokens, a
wrong role) in OpenAI's shape instead; aioserve keeps the route's one shape. As in vLLM,
the API key (--api-key) is read from `Authorization: Bearer` only, not from Anthropic's
`x-api-key` (with the SDK: `auth_token=`, ANTHROPIC_AUTH_TOKEN).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from aioserve.engine.lora_requests import LoRARequest
from aioserve.server.anthropic_request import (
    COUNT_TOKENS_FIELDS,
    EFFORTS,
    MESSAGES_FIELDS,
    messages_chat_body,
    thinking_type,
)
from aioserve.server.anthropic_stream import (
    anthropic_events,
    anthropic_stop_reason,
    anthropic_usage,
    new_signature,
)
from aioserve.server.body_fields import log_ignored_fields, read_json_body
from aioserve.server.chat import chat_chunks, full_chat_body, settle_reasoning
from aioserve.server.chat_images import read_request_images, widened_prompt_ids
from aioserve.server.chat_template import render_chat, template_kwargs
from aioserve.server.errors import APIError
from aioserve.server.generation import engine_outputs, reserve_places
from aioserve.server.protocol import ChatRequest, check_prompt, check_serving, parse_chat_request
from aioserve.server.responses import ResponseHead
from aioserve.server.sse import stream_events
from aioserve.server.state import STATE, ServerState
from aioserve.server.structured_output_fields import compile_structured_output
from aioserve.server.tracing import request_trace

logger = logging.getLogger("aioserve.server")

_PROBES = web.AppKey("anthropic_probes", dict)
"""What the chat template was found to need (found once, at the first request)."""
_SYSTEM_FIRST_WARNING = (
    "The chat template requires system-first ordering, so inline system messages in "
    "/v1/messages requests (e.g. Claude Code's per-turn reminders) are merged into the "
    "leading system prompt. Each new one changes the prompt prefix, so the rest of the "
    "conversation misses the prefix cache. Pass a --chat-template that accepts non-leading "
    "system messages to avoid this."
)  # vLLM's words


async def create_message(request: web.Request) -> web.StreamResponse:
    """The POST /v1/messages handler."""
    try:
        return await _create_message(request)
    except APIError as error:
        return anthropic_error(error)
    except Exception:
        logger.exception("unhandled error in POST %s", request.path)
        return anthropic_error(APIError("internal server error", HTTPStatus.INTERNAL_SERVER_ERROR))


async def count_tokens(request: web.Request) -> web.Response:
    """The POST /v1/messages/count_tokens handler."""
    try:
        parsed, _ = await messages_chat_request(request, count_only=True)
        _, token_ids = await _render(request.app[STATE], parsed)
    except APIError as error:
        return anthropic_error(error)
    count = len(token_ids)
    return web.json_response(
        {"input_tokens": count, "context_management": {"original_input_tokens": count}}
    )


def anthropic_error(error: APIError) -> web.Response:
    """An error in Anthropic's shape, with its status and headers (Retry-After, ...)."""
    body = {"type": "error", "error": {"type": error.error_type, "message": error.message}}
    return web.Response(
        body=orjson.dumps(body),
        status=error.status,
        content_type="application/json",
        headers=error.headers,
    )


async def messages_chat_request(
    request: web.Request, *, count_only: bool = False, probe_disabled_effort: bool = True
) -> tuple[ChatRequest, LoRARequest | None]:
    """The request's body, translated to chat's and read as chat reads it; the LoRA
    adapter its model names, if any. Without `probe_disabled_effort`, `thinking:
    {"type": "disabled"}` is reasoning_effort "none" whatever the template does with it
    (vLLM's /v1/messages/render converts with that default)."""
    state = request.app[STATE]
    body = await read_json_body(request)
    lora = check_serving(state, body)
    probes = request.app[_PROBES]
    effort = "none"
    if thinking_type(body) == "disabled" and probe_disabled_effort:
        effort = state.frontend.anthropic_disabled_thinking_effort
        if effort == "auto":
            effort = await _probed(state, probes, "disabled_effort", _disabled_thinking_effort)
    chat_body = messages_chat_body(
        body,
        state.model_name,
        merge_inline_system=await _probed(state, probes, "system_first", _needs_system_first),
        disabled_thinking_effort=effort,
        count_only=count_only,
        takes_images=state.engine.image_processor is not None,
    )
    log_ignored_fields(body, COUNT_TOKENS_FIELDS if count_only else MESSAGES_FIELDS)
    parsed = parse_chat_request(state, chat_body, request.headers)
    if parsed.structured_output_field == "response_format":
        parsed.structured_output_field = "output_config.format"
    return parsed, lora


async def _render(state: ServerState, parsed: ChatRequest) -> tuple[str, list[int]]:
    """The prompt's text and token ids, its images read (chat_images.py) and their
    placeholders widened."""
    placeholder = await read_request_images(state.engine, parsed)
    text, token_ids = await state.off_loop(
        render_chat,
        state,
        parsed.messages,
        add_generation_prompt=parsed.add_generation_prompt,
        continue_final_message=parsed.continue_final_message,
        chat_template_kwargs=parsed.chat_template_kwargs,
        tools=parsed.tool_use.tools,
        add_special_tokens=parsed.add_special_tokens,
        image_placeholder=placeholder,
    )
    if parsed.images:
        token_ids = widened_prompt_ids(state.engine, token_ids, len(parsed.images))
    return text, token_ids


async def _create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    parsed, lora = await messages_chat_request(request)
    engine = state.engine
    await compile_structured_output(engine, parsed.params, parsed.structured_output_field)
    with reserve_places(engine, 1) as reservation:
        text, token_ids = await _render(state, parsed)
        prompt_closed = settle_reasoning(state, parsed, text)
        parsed.params = check_prompt(engine, token_ids, parsed, "messages")
        role = state.frontend.response_role
        object_name = "chat.completion.chunk" if parsed.stream else "chat.completion"
        head = ResponseHead.new(
            f"chatcmpl-{parsed.request_id}", object_name, state.response_model(lora)
        )
        outputs = engine_outputs(
            engine,
            parsed.engine_prompt(text, token_ids),
            parsed.params,
            head.id,
            parsed.priority,
            reservation,
            lora,
            request_trace(state.tracer, request.headers, head.model),
        )
        chat = (state, parsed, None, token_ids, prompt_closed, role, "", head, outputs)
        if parsed.stream:
            return await stream_events(request, anthropic_events(chat_chunks(*chat)), named=True)
        message = message_body(await full_chat_body(*chat))
        return web.Response(body=orjson.dumps(message), content_type="application/json")


def message_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A (non-streamed) chat completion as a message (vLLM's messages_full_converter)."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    stop_reason, stop_sequence = anthropic_stop_reason(
        choice["finish_reason"], choice["stop_reason"], bool(calls), bool(calls)
    )
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append(
            {"type": "thinking", "thinking": message["reasoning"], "signature": new_signature()}
        )
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _call_input(function["arguments"]),
            }
        )
    body: dict[str, Any] = {
        "id": chat["id"],
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],
        "model": chat["model"],
    }
    if stop_reason is not None:
        body["stop_reason"] = stop_reason
    if stop_sequence is not None:
        body["stop_sequence"] = stop_sequence
    body["usage"] = anthropic_usage(chat["usage"])
    return body


def _call_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's input (a JSON object)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as error:  # vLLM's 400 for it
        raise APIError(f"a tool call's arguments are not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise APIError("a tool call's arguments are not a JSON object")
    return value


async def _probed(state: ServerState, probes: dict, name: str, probe) -> Any:
    """The probe's answer for this server, found once (off the event loop)."""
    if name not in probes:
        probes[name] = await state.off_loop(probe, state)
    return probes[name]


def _needs_system_first(state: ServerState) -> bool:
    """Whether the chat template refuses a system message after the first message (vLLM
    renders system, user, system, user, with and without tools)."""
    messages = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    for tools in (None, []):
        try:
            render_chat(state, messages, add_generation_prompt=False, tools=tools)
        except APIError:
            logger.warning(_SYSTEM_FIRST_WARNING)
            return True
    return False


def _disabled_thinking_effort(state: ServerState) -> str:
    """The reasoning_effort for thinking "disabled": "none", unless the template refuses
    it or renders it as one of the thinking efforts (then "low"), vLLM's probe."""

    def prompt(effort: str) -> str | None:
        kwargs = template_kwargs(None, None, reasoning_effort=effort)
        try:
            text, _ = render_chat(
                state, [{"role": "user", "content": "Hi"}], chat_template_kwargs=kwargs
            )
        except APIError:
            return None
        return text

    unthinking = prompt("none")
    if unthinking is None or any(prompt(effort) == unthinking for effort in EFFORTS):
        effort = "low"
    else:
        effort = "none"
    logger.info("Anthropic thinking.type=disabled maps to reasoning_effort=%r", effort)
    return effort


def add_anthropic_routes(app: web.Application) -> None:
    """Register POST /v1/messages and POST /v1/messages/count_tokens on `app`."""
    app[_PROBES] = {}
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


_MESSAGE_FIELDS = {
    "model": {"type": "string"},
    "messages": {"type": "array", "items": {"$ref": "#/components/schemas/AnthropicMessage"}},
    "system": {"type": ["string", "array"], "description": "A string or text blocks"},
    "tools": {
        "type": "array",
        "items": {"type": "object", "required": ["name", "input_schema"]},
        "description": "{name, description, input_schema, strict, defer_loading}",
    },
    "tool_choice": {"type": "object", "description": "type: auto, any, tool (with name), none"},
    "output_config": {"type": "object", "description": "format (json_schema), effort"},
    "thinking": {"type": "object", "description": "type: disabled or adaptive"},
    "chat_template_kwargs": {"type": "object"},
}
_ERROR = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
_ERRORS = {
    status: {"description": what, "content": {"application/json": {"schema": _ERROR}}}
    for status, what in (
        ("400", "Bad request, in Anthropic's error shape"),
        ("404", "Unknown model"),
        ("401", "Missing or wrong API key (--api-key, as Authorization: Bearer)"),
    )
}
ANTHROPIC_SCHEMAS: dict[str, Any] = {
    "AnthropicMessage": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["user", "assistant", "system"]},
            "content": {
                "type": ["string", "array"],
                "description": "A string, or blocks: text, image (for a model that takes "
                "images), tool_use, tool_result, thinking",
            },
        },
    },
    "AnthropicMessagesRequest": {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "description": "Anthropic's Messages API, run as a chat completion.",
        "properties": {
            **_MESSAGE_FIELDS,
            "max_tokens": {"type": "integer", "minimum": 1},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "temperature": {"type": "number"},
            "top_p": {"type": "number"},
            "top_k": {"type": "integer"},
            "metadata": {"type": "object"},
            "stream": {"type": "boolean", "default": False},
            "cache_salt": {"type": "string"},
            "vllm_xargs": {"type": "object"},
        },
    },
    "AnthropicMessagesResponse": {
        "type": "object",
        "description": "With stream=true: text/event-stream of Anthropic's named events, "
        "message_start first and message_stop last.",
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "content": {"type": "array", "items": {"type": "object"}},
            "model": {"type": "string"},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
            "stop_sequence": {"type": "string"},
            "usage": {"type": "object"},
        },
    },
    "AnthropicCountTokensRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": _MESSAGE_FIELDS,
    },
    "AnthropicCountTokensResponse": {
        "type": "object",
        "properties": {
            "input_tokens": {"type": "integer"},
            "context_management": {
                "type": "object",
                "properties": {"original_input_tokens": {"type": "integer"}},
            },
        },
    },
    "AnthropicErrorResponse": {
        "type": "object",
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}
"""/openapi.json's schemas of these routes (openapi.py lists them)."""


def _operation(summary: str, request: str, response: str) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{response}"}
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}
            },
        },
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
            **_ERRORS,
        },
    }


ANTHROPIC_OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/messages"): _operation(
        "Answer an Anthropic Messages request (streams with stream=true)",
        "AnthropicMessagesRequest",
        "AnthropicMessagesResponse",
    ),
    ("post", "/v1/messages/count_tokens"): _operation(
        "Count the tokens of a Messages request's prompt",
        "AnthropicCountTokensRequest",
        "AnthropicCountTokensResponse",
    ),
}
"""/openapi.json's operations of these routes."""
