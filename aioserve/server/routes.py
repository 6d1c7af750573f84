"""The routes that do not generate: models, probes, version, tokenize, detokenize, load.

Response shapes are vLLM's (shared/reference/vllm_samples 01, 02, 03, 11, 12, 13):

    GET  /v1/models      {"object": "list", "data": [model card per served name]}
    GET  /health         200, empty body; 503 (saying why) once the engine has died or
                         its loop has stalled (engine/health.py)
    GET|POST /ping       the same as /health (SageMaker's probe)
    GET  /version        {"version": "<aioserve version>"}
    POST /tokenize       {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize     {"prompt"}
    GET  /load           {"server_load": <requests in flight>} (0 without --enable-server-load-tracking)

/tokenize takes `prompt` (a string; `add_special_tokens` defaults to true) or `messages`
(rendered with the chat template as for chat, chat_template.py; `add_generation_prompt`
defaults to true, `add_special_tokens` to false, since the template writes the special
tokens), and `return_token_strs` for the tokens' strings. As in vLLM, a request's own chat
template, per-request multimodal kwargs, and `add_generation_prompt` with
`continue_final_message` both true are 400s. Keys outside the fields of vLLM's request
model for the route are logged as vLLM logs them (body_fields.log_ignored_fields).
"""

from __future__ import annotations

import time
import uuid
from http import HTTPStatus

from aiohttp import web

from aioserve import __version__
from aioserve.server.body_fields import (
    log_ignored_fields,
    optional_bool,
    read_json_body,
    shown_value,
)
from aioserve.server.chat_images import (
    check_image_count,
    image_placeholder,
    image_urls,
    widened_prompt_ids,
)
from aioserve.server.chat_template import (
    BOTH_GENERATION_FLAGS,
    refuse_request_mm_kwargs,
    refuse_request_template,
    render_chat,
)
from aioserve.server.errors import APIError, bad_parameter
from aioserve.server.middlewares import IN_FLIGHT
from aioserve.server.protocol import check_serving
from aioserve.server.request_fields import (
    DETOKENIZE_FIELDS,
    TOKENIZE_CHAT_FIELDS,
    TOKENIZE_PROMPT_FIELDS,
)
from aioserve.server.state import STATE, ServerState
from aioserve.server.tools import checked_tools


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: one model card per served name, the first name first, then one per
    LoRA adapter (its folder as root, its base model as parent)."""
    state = request.app[STATE]
    created = int(time.time())
    settings = state.engine.settings
    cards = [
        _model_card(name, created, settings.model_name, None, settings.max_model_len)
        for name in state.served_model_names
    ]
    cards += [
        _model_card(name, created, adapter.request.lora_path, adapter.base_model_name, None)
        for name, adapter in state.loras.adapters.items()
    ]
    return web.json_response({"object": "list", "data": cards})


def _model_card(
    name: str, created: int, root: str, parent: str | None, max_model_len: int | None
) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "aioserve",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


async def health(request: web.Request) -> web.Response:
    """GET /health, GET|POST /ping: 200 with an empty body while the engine can serve."""
    problem = request.app[STATE].engine.health_problem()
    if problem is not None:
        raise APIError(f"unhealthy: {problem}", HTTPStatus.SERVICE_UNAVAILABLE)
    return web.Response()


async def version(request: web.Request) -> web.Response:
    """GET /version."""
    return web.json_response({"version": __version__})


async def server_load(request: web.Request) -> web.Response:
    """GET /load: how many requests are in flight (probes not counted)."""
    return web.json_response({"server_load": request.app[IN_FLIGHT].count})


async def untracked_load(request: web.Request) -> web.Response:
    """GET /load without --enable-server-load-tracking: 0, as vLLM answers then."""
    return web.json_response({"server_load": 0})


def _tokenizer(state: ServerState):
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError("this needs the tokenizer, which is not loaded (--skip-tokenizer-init)")
    return tokenizer


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: the token ids of a prompt, or of chat messages through the template."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    tokenizer = _tokenizer(state)
    # vLLM's request models refuse both set, whichever of its two models the body is.
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise APIError(BOTH_GENERATION_FLAGS)
    chat = body.get("messages") is not None
    if chat:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_parameter(
                "messages", shown_value(messages), "messages must be a non-empty array"
            )
        chat_template_kwargs = body.get("chat_template_kwargs")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise bad_parameter(
                "chat_template_kwargs",
                shown_value(chat_template_kwargs),
                "chat_template_kwargs must be an object",
            )
        chat_template = body.get("chat_template")
        refuse_request_template(
            chat_template,
            chat_template_kwargs,
            trusted=state.frontend.trust_request_chat_template,
        )
        refuse_request_mm_kwargs(body)
        # An image model's placeholders are widened to the rows each image takes, which
        # depend on the model, not on the image: the images themselves are not read.
        placeholder = image_placeholder(state.engine)
        _, tokens = await state.off_loop(
            render_chat,
            state,
            messages,
            add_generation_prompt=optional_bool(body, "add_generation_prompt", True),
            continue_final_message=optional_bool(body, "continue_final_message", False),
            chat_template_kwargs=chat_template_kwargs,
            tools=checked_tools(body.get("tools")),
            add_special_tokens=optional_bool(body, "add_special_tokens", False),
            chat_template=chat_template,
            image_placeholder=placeholder,
        )
        num_images = len(image_urls(messages)) if placeholder is not None else 0
        if num_images:
            check_image_count(state.engine, num_images)
            tokens = widened_prompt_ids(state.engine, tokens, num_images)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_parameter(
                "prompt",
                shown_value(prompt),
                "prompt must be a string (or send messages instead)",
            )
        add_special_tokens = optional_bool(body, "add_special_tokens", True)
        # vLLM reads these off any tokenize request, a prompt one too.
        refuse_request_mm_kwargs(body)
        encoded = await state.off_loop(tokenizer, prompt, add_special_tokens=add_special_tokens)
        tokens = encoded.input_ids
    token_strs = None
    if optional_bool(body, "return_token_strs", False):
        token_strs = tokenizer.convert_ids_to_tokens(tokens)
    # As vLLM's TokenizeRequest union resolves: the chat model when messages are given.
    log_ignored_fields(body, TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_PROMPT_FIELDS)
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": state.engine.settings.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: the text of a list of token ids."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    tokenizer = _tokenizer(state)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise bad_parameter("tokens", shown_value(tokens), "tokens must be an array of integers")
    vocab_size = state.engine.hf_config.vocab_size
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise bad_parameter(
                "tokens",
                token,
                f"token id {token} is out of vocabulary (the model has {vocab_size} tokens)",
            )
    log_ignored_fields(body, DETOKENIZE_FIELDS)
    return web.json_response({"prompt": await state.off_loop(tokenizer.decode, tokens)})


def add_routes(app: web.Application, *, load_tracking: bool) -> None:
    """Register this module's routes on `app` (GET routes answer HEAD as well)."""
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/load", server_load if load_tracking else untracked_load)
