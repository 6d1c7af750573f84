"""POST /v1/responses: OpenAI's Responses API for text, as vLLM 0.32 serves it by default.

A response is one chat turn: its messages come from `instructions` and the `input` items
(responses_input.py), and the request is validated, rendered and run as a chat completion
with chat's sampling fields (`max_output_tokens` is chat's max_tokens; the response
repeats what the request may produce, as vLLM's); a `request_id` given is the response's
id. `text.format` (json_schema, json_object) constrains the answer through structured
outputs. The answer comes back as output items, streamed as vLLM's named events
(responses_output.py): with --reasoning-parser a reasoning item first (dropped with
`include_reasoning: false`), a message, and function_call items.

Function tools work as chat's tools (tool_choice required or a function by name,
enforced by structured outputs; auto, read by --tool-call-parser with
--enable-auto-tool-choice; parallel_tool_calls). On a server without those flags, "auto"
(the default with tools) renders the tools and reads the answer as text, as vLLM's
Responses route does, where chat refuses it.

As vLLM without VLLM_ENABLE_RESPONSES_API_STORE (its default), nothing is stored: `store`
is accepted and has no effect, `previous_response_id` names a response that is not found
(404), `background` is refused, and GET /v1/responses/{id} and its cancel route answer
404. Not supported yet, and refused by name: other kinds of tools (web search, MCP, ...),
the logprobs `include` ("message.output_text.logprobs"; its other values are accepted
and change nothing, as in vLLM, and so is `top_logprobs` without it), `max_tool_calls`,
`prompt` templates and `truncation: "auto"`.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from aioserve.config.frontend import FrontendConfig
from aioserve.engine.admission import max_new_tokens
from aioserve.server.body_fields import read_json_body, shown_value
from aioserve.server.chat import settle_reasoning
from aioserve.server.chat_images import read_request_images, widened_prompt_ids
from aioserve.server.chat_template import render_chat
from aioserve.server.errors import APIError, bad_parameter, refusal
from aioserve.server.generation import engine_outputs, reserve_places
from aioserve.server.output_log import COMPLETE, OutputLog, output_log
from aioserve.server.protocol import check_prompt, check_serving, parse_chat_request
from aioserve.server.reasoning import ReasoningSplitter
from aioserve.server.responses_input import input_messages
from aioserve.server.responses_output import ResponseBuilder, response_events
from aioserve.server.sse import stream_events
from aioserve.server.state import STATE
from aioserve.server.structured_output_fields import compile_structured_output
from aioserve.server.tracing import request_trace

# Sampling fields a Responses request shares with chat completions, under the same names.
# vLLM-only fields chat refuses (watermarking, kv_transfer_params, ...) go along to be
# refused there too.
_CHAT_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "request_id",
    "priority", "stream", "user", "include_reasoning", "cache_salt", "chat_template_kwargs",
    "structured_outputs", "watermarking", "vllm_xargs", "kv_transfer_params",
    "mm_processor_kwargs", "media_io_kwargs",
)  # fmt: skip
# Fields of features aioserve does not implement yet for this route: refused by name.
_NOT_YET = {
    "prompt": "prompt templates",
    "max_tool_calls": "max_tool_calls",
}
# The one `include` value that changes an answer (vLLM accepts and ignores the others).
_LOGPROBS_INCLUDE = "message.output_text.logprobs"


async def create_response(request: web.Request) -> web.StreamResponse:
    """The POST /v1/responses handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    lora = check_serving(state, body)
    parses_calls = auto_tools(state.frontend)
    takes_images = state.engine.image_processor is not None
    chat_body = as_chat_body(body, state.model_name, parses_calls, takes_images=takes_images)
    parsed = parse_chat_request(state, chat_body, request.headers)
    parsed.max_tokens_field = "max_output_tokens"
    if "response_format" in chat_body:
        parsed.structured_output_field = "text.format"
    engine = state.engine
    await compile_structured_output(engine, parsed.params, parsed.structured_output_field)
    with reserve_places(engine, 1) as reservation:
        placeholder = await read_request_images(engine, parsed)
        text, token_ids = await state.off_loop(
            render_chat,
            state,
            parsed.messages,
            add_generation_prompt=parsed.add_generation_prompt,
            continue_final_message=parsed.continue_final_message,
            chat_template_kwargs=parsed.chat_template_kwargs,
            tools=parsed.tool_use.tools,
            image_placeholder=placeholder,
        )
        if parsed.images:
            token_ids = widened_prompt_ids(engine, token_ids, len(parsed.images))
        prompt_closed = settle_reasoning(state, parsed, text)
        parser = engine.settings.reasoning_parser
        splitter = None
        if parser:
            splitter = ReasoningSplitter(parser, parsed.chat_template_kwargs, prompt_closed)
        parsed.params = check_prompt(engine, token_ids, parsed, "input")
        params = parsed.params
        request_id = body.get("request_id")  # vLLM's: the response's id, as given
        response = ResponseBuilder(
            request_id if isinstance(request_id, str) else f"resp_{secrets.token_hex(8)}",
            state.response_model(lora),
            body,
            {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "presence_penalty": params.presence_penalty,
                "frequency_penalty": params.frequency_penalty,
                "max_output_tokens": max_new_tokens(engine.settings, len(token_ids), params),
            },
            len(token_ids),
            splitter,
            lambda ids: engine.tokenizer.decode(
                ids, skip_special_tokens=params.skip_special_tokens
            ),
            parsed.tool_use,
            parses_calls,
        )
        response.with_metrics = state.frontend.enable_per_request_metrics
        log = output_log(state.frontend)
        outputs = engine_outputs(
            engine,
            parsed.engine_prompt(text, token_ids),
            parsed.params,
            response.id,
            parsed.priority,
            reservation,
            lora,
            request_trace(state.tracer, request.headers, state.response_model(lora)),
        )
        if parsed.stream:
            events = _logged(response_events(response, outputs), response, log)
            return await stream_events(request, events, named=True)
        async with aclosing(outputs):
            async for output in outputs:
                final = output
        response.add_whole(final)
        if log is not None:
            log.log(response.id, response.text, response.token_ids, response.finish_reason)
        return web.Response(body=orjson.dumps(response.body()), content_type="application/json")


async def _logged(
    events: AsyncIterator[dict[str, Any]], response: ResponseBuilder, log: OutputLog | None
) -> AsyncIterator[dict[str, Any]]:
    """The stream's events; then, once it has ended well, the whole answer in the output
    log (--enable-log-outputs), as vLLM logs a streamed response."""
    async with aclosing(events):
        async for event in events:
            yield event
    if log is not None and response.status != "in_progress":
        log.log(response.id, response.text, response.token_ids, response.finish_reason, COMPLETE)


async def stored_response_not_found(request: web.Request) -> web.Response:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: nothing is stored."""
    raise _not_found(request.match_info["response_id"])


def _not_found(response_id: str) -> APIError:
    return APIError(
        f"Response with id '{response_id}' not found.",
        HTTPStatus.NOT_FOUND,
        param="response_id",
    )


def auto_tools(frontend: FrontendConfig) -> bool:
    """Whether the server reads calls out of answers (--enable-auto-tool-choice with a
    --tool-call-parser)."""
    return bool(frontend.enable_auto_tool_choice and frontend.tool_call_parser)


def as_chat_body(
    body: dict[str, Any],
    model_name: str,
    parses_calls: bool,
    *,
    render: bool = False,
    takes_images: bool = False,
) -> dict[str, Any]:
    """The chat completions body that runs this Responses request; 400 or 404 for what a
    Responses request cannot ask of aioserve. Without `parses_calls`, tool_choice "auto"
    (the default with tools) renders the tools and reads the answer as text, as vLLM's
    Responses route does (chat refuses it). `render`: for /v1/responses/render, which
    refuses a `previous_response_id` first, as vLLM's stateless render does."""
    if render and body.get("previous_response_id") is not None:
        raise APIError(
            "previous_response_id is not supported by the stateless render endpoint.",
            param="previous_response_id",
            error_type="invalid_request_error",
        )
    for name, what in _NOT_YET.items():
        if body.get(name) not in (None, [], {}):
            raise bad_parameter(
                name, shown_value(body[name]), f"{what} in /v1/responses is not supported yet"
            )
    if body.get("background"):
        if body.get("store", True) is False:
            raise refusal("background can only be used when `store` is true", "background")
        raise APIError(
            "aioserve does not store responses (as vLLM without "
            "VLLM_ENABLE_RESPONSES_API_STORE) and therefore does not support the background "
            "mode.",
            param="background",
        )
    _check_echoed_fields(body)
    include = body.get("include")
    if isinstance(include, list) and _LOGPROBS_INCLUDE in include:
        raise bad_parameter(
            "include",
            shown_value(include),
            f"include {_LOGPROBS_INCLUDE!r} (logprobs) in /v1/responses is not supported yet",
        )
    if body.get("previous_response_id") is not None:
        raise _not_found(str(body["previous_response_id"]))
    tools = body.get("tools")
    if not tools and body.get("tool_choice") not in (None, "auto", "none"):
        kind = "required" if body["tool_choice"] == "required" else "function"
        raise refusal(
            f"Tool choice '{kind}' must be specified with 'tools' parameter.", "tool_choice"
        )
    if body.get("truncation") not in (None, "disabled"):
        raise bad_parameter(
            "truncation",
            shown_value(body["truncation"]),
            "truncation 'auto' in /v1/responses is not supported yet",
        )
    chat = {name: body[name] for name in _CHAT_FIELDS if name in body}
    chat["messages"] = input_messages(body, model_name, takes_images)
    if tools:  # the Responses API's default is [], no tools
        chat["tools"] = _chat_tools(tools)
        choice = body.get("tool_choice", "auto")
        chat["tool_choice"] = _chat_tool_choice(
            "none" if choice == "auto" and not parses_calls else choice
        )
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    last = body["input"][-1] if isinstance(body["input"], list) and body["input"] else None
    if (
        isinstance(last, dict)
        and last.get("role") == "assistant"
        and last.get("status") in ("in_progress", "incomplete")
    ):
        # An unfinished assistant message is continued, as vLLM continues it.
        chat.update(add_generation_prompt=False, continue_final_message=True)
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    if (response_format := _response_format(body.get("text"))) is not None:
        if body.get("structured_outputs") is not None:
            raise refusal(
                "Cannot specify both structured_outputs and text.format", "structured_outputs"
            )
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """The Responses API's function tools ({type, name, parameters, ...}) in chat's form
    ({type, function: {name, parameters, ...}}); 400 for the other kinds of tools."""
    if not isinstance(tools, list):
        raise bad_parameter("tools", shown_value(tools), "tools must be an array")
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_parameter(
                f"tools[{i}]",
                shown_value(tool),
                f"tools of type {kind!r} are not supported yet; only function tools are",
            )
        keys = ("name", "description", "parameters", "strict")
        converted.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    return converted


def _chat_tool_choice(choice: Any) -> Any:
    """The Responses API's tool_choice in chat's form: a named function is
    {type: "function", name} there, {type: "function", function: {name}} in chat."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("auto", "none", "required"):
        return choice
    raise bad_parameter(
        "tool_choice",
        shown_value(choice),
        "tool_choice must be auto, none, required or a function by name",
    )


_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


def _check_echoed_fields(body: dict[str, Any]) -> None:
    """400 for the fields the response repeats when they are not what OpenAI's types say."""
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad_parameter(
            "metadata", shown_value(metadata), "metadata must be an object of strings"
        )
    if "service_tier" in body and body["service_tier"] not in _SERVICE_TIERS:
        raise bad_parameter(
            "service_tier",
            shown_value(body["service_tier"]),
            f"service_tier must be one of {', '.join(_SERVICE_TIERS)}",
        )
    for name in ("reasoning", "text"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise bad_parameter(name, shown_value(body[name]), f"{name} must be an object")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_parameter(
            "parallel_tool_calls", shown_value(parallel), "parallel_tool_calls must be a boolean"
        )


def _response_format(text: Any) -> dict[str, Any] | None:
    """Chat's response_format for the Responses `text.format`, None for plain text."""
    fmt = (text or {}).get("format")  # `text` is an object or null (_check_echoed_fields)
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {
            key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt
        }
        return {"type": "json_schema", "json_schema": schema}
    raise bad_parameter(
        "text.format", shown_value(fmt), "text.format must be text, json_object or json_schema"
    )
