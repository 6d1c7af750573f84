"""POST /v1/completions/render, /v1/chat/completions/render, /v1/messages/render and
/v1/responses/render: a request as vLLM 0.32's scale-out `GenerateRequest` (its
render/serving.py), nothing generated.

The body is read as /v1/completions, /v1/chat/completions, /v1/messages and /v1/responses
read theirs (protocol.py; a Messages request translated to chat's by anthropic_request.py,
a Responses request by responses_api.py): the same checks, the same chat template
rendering and tokenization, the same sampling parameters with max_tokens cut to the room
the prompt leaves. What comes back is what POST /inference/v1/generate takes: the prompt's
token ids, the sampling params as vLLM writes them (vllm_sampling_wire.py), `model` as the
request gave it, `stream` and `stream_options`, `cache_salt` and `priority`. Completions
answer a list, one GenerateRequest per prompt (request ids "cmpl-<id>", or "cmpl-<id>-<i>"
for several prompts); chat one ("chatcmpl-<id>"), with `reasoning_ended` (true when the
reasoning is not wanted; with --reasoning-parser whether the prompt closed it; else null)
and, with a reasoning parser, the chat template's kwargs for it.

A Messages request renders as the chat request it becomes ("chatcmpl-<id>"; a stream with
usage in every chunk), with `thinking: {"type": "disabled"}` as reasoning_effort "none"
whatever --anthropic-disabled-thinking-effort says (vLLM's render converts with that
default). A Responses request's GenerateRequest has the response's id (`request_id`, else
"resp_<id>"; an X-Request-Id header does not name it, as in vLLM), no stream_options and no
reasoning_ended, and its sampling params always write `extra_args` (vLLM's Responses
request does); `previous_response_id` is refused first (400, vLLM's words: the render is
stateless), and the rest as /v1/responses refuses it.

Refused as vLLM refuses them: beam search ("Beam search is not supported by the render
endpoint"); and prompts sent as embeddings, which have no token ids to render. Errors are
OpenAI's shape on every render route, /v1/messages/render included (as vLLM's).
"""

from __future__ import annotations

import dataclasses
import uuid
from http import HTTPStatus
from typing import Any

from aiohttp import web

from aioserve.server.anthropic_api import messages_chat_request
from aioserve.server.body_fields import read_json_body
from aioserve.server.chat import chat_prompt
from aioserve.server.chat_images import image_placeholder, image_urls
from aioserve.server.completions import tokenized_prompts
from aioserve.server.errors import APIError
from aioserve.server.protocol import (
    ChatRequest,
    GenerationRequest,
    check_prompt,
    check_serving,
    parse_chat_request,
    parse_completion_request,
)
from aioserve.server.responses_api import as_chat_body, auto_tools
from aioserve.server.state import STATE, ServerState
from aioserve.server.vllm_sampling_wire import to_wire

BEAM_SEARCH = "Beam search is not supported by the render endpoint"


async def render_completion(request: web.Request) -> web.Response:
    """POST /v1/completions/render: one GenerateRequest per prompt."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    parsed = parse_completion_request(state, body, request.headers)
    if parsed.beam_search is not None:
        raise APIError(BEAM_SEARCH)
    if parsed.prompt_embeds:
        raise APIError(
            "prompt_embeds cannot be rendered: a render answers token ids",
            param="prompt_embeds",
        )
    prompts = await tokenized_prompts(state, parsed)
    base_id = f"cmpl-{parsed.request_id}"
    rendered = []
    for i, prompt in enumerate(prompts):
        params = check_prompt(state.engine, prompt.token_ids, parsed, "prompt")
        request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
        rendered.append(
            _generate_request(request_id, prompt.token_ids, params, body, parsed, None, None)
        )
    return web.json_response(rendered)


async def render_chat_completion(request: web.Request) -> web.Response:
    """POST /v1/chat/completions/render: the chat template applied, one GenerateRequest."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    parsed = parse_chat_request(state, body, request.headers)
    return web.json_response(await _rendered_chat(state, parsed, body))


async def render_messages(request: web.Request) -> web.Response:
    """POST /v1/messages/render: the Messages request as /v1/messages turns it into a chat
    request, rendered as /v1/chat/completions/render renders that one."""
    parsed, _ = await messages_chat_request(request, probe_disabled_effort=False)
    body = await read_json_body(request)
    chat_body = {"model": body.get("model")}
    if parsed.stream:  # vLLM's conversion asks a stream for usage in every chunk
        chat_body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return web.json_response(await _rendered_chat(request.app[STATE], parsed, chat_body))


async def render_responses(request: web.Request) -> web.Response:
    """POST /v1/responses/render: the Responses request as /v1/responses runs it (its
    messages, template and chat sampling fields), one GenerateRequest whose id is the
    response's (`request_id`, else "resp_<id>")."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    chat_body = as_chat_body(body, state.model_name, auto_tools(state.frontend), render=True)
    parsed = parse_chat_request(state, chat_body, {})  # vLLM's: the id ignores X-Request-Id
    parsed.max_tokens_field = "max_output_tokens"
    if "response_format" in chat_body:
        parsed.structured_output_field = "text.format"
    _refuse_images(state, parsed)
    _, _, token_ids, _ = await chat_prompt(state, parsed, "input")
    params = parsed.params
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=_room(state, token_ids))
    if params.extra_args is None:  # vLLM's Responses request always writes its extra_args
        params = dataclasses.replace(params, extra_args={})
    request_id = body.get("request_id")
    rendered = _generate_request(
        request_id if isinstance(request_id, str) else f"resp_{uuid.uuid4().hex[:16]}",
        token_ids,
        params,
        body,
        parsed,
        None,
        _parser_kwargs(state, parsed),
        stream_options=False,
    )
    return web.json_response(rendered)


def _refuse_images(state: ServerState, parsed: ChatRequest) -> None:
    """501 for an image model's request with images: vLLM's GenerateRequest carries their
    processed features, which aioserve does not render yet. (A text model's chat refuses
    image parts as it renders.)"""
    if image_placeholder(state.engine) is not None and image_urls(parsed.messages):
        raise APIError(
            "rendering prompts with images is not supported by aioserve yet",
            HTTPStatus.NOT_IMPLEMENTED,
        )


async def _rendered_chat(
    state: ServerState, parsed: ChatRequest, body: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's GenerateRequest of a chat request (render_chat_request); `body` gives its
    `model` and `stream_options`."""
    if parsed.beam_search is not None:
        raise APIError(BEAM_SEARCH)
    _refuse_images(state, parsed)
    _, _, token_ids, prompt_closed = await chat_prompt(state, parsed)
    if parsed.params.max_tokens is None:  # the rest of the context, as vLLM writes it
        parsed.params = dataclasses.replace(parsed.params, max_tokens=_room(state, token_ids))
    if not parsed.include_reasoning:
        reasoning_ended: bool | None = True
    else:
        reasoning_ended = prompt_closed if state.engine.settings.reasoning_parser else None
    return _generate_request(
        f"chatcmpl-{parsed.request_id}",
        token_ids,
        parsed.params,
        body,
        parsed,
        reasoning_ended,
        _parser_kwargs(state, parsed),
    )


def _room(state: ServerState, token_ids: list[int]) -> int:
    return state.engine.settings.max_model_len - len(token_ids)


def _parser_kwargs(state: ServerState, parsed: ChatRequest) -> dict[str, Any] | None:
    """vLLM's ReasoningParserKwargs: the template's kwargs, with a --reasoning-parser."""
    if not state.engine.settings.reasoning_parser:
        return None
    return {"chat_template_kwargs": parsed.chat_template_kwargs or {}}


def _generate_request(
    request_id: str,
    token_ids: list[int],
    params: Any,
    body: dict[str, Any],
    parsed: GenerationRequest,
    reasoning_ended: bool | None,
    reasoning_parser_kwargs: dict[str, Any] | None,
    *,
    stream_options: bool = True,
) -> dict[str, Any]:
    """vLLM's GenerateRequest.model_dump(), field by field (`stream_options`: whether the
    request has them)."""
    options = None
    given = body.get("stream_options")
    if parsed.stream and stream_options and given is not None:
        # vLLM's StreamOptions, its defaults filled in
        options = {
            "include_usage": given.get("include_usage", False),
            "continuous_usage_stats": given.get("continuous_usage_stats", False),
        }
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": to_wire(params, top_k_off=-1 if body.get("top_k") == -1 else 0),
        "model": body.get("model"),
        "reasoning_ended": reasoning_ended,
        "reasoning_parser_kwargs": reasoning_parser_kwargs,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": parsed.stream,
        "stream_options": options,
        "cache_salt": parsed.cache_salt,
        "priority": parsed.priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }
