"""/openapi.json's operations and schemas of the scale-out routes (scale_out.py), in the
shapes of vLLM 0.32's GenerateRequest, GenerateTokensResponse and the derender requests
(vllm/entrypoints/scale_out/token_in_token_out/protocol.py)."""

from __future__ import annotations

from typing import Any

_INTEGER = {"type": "integer"}
_STRING = {"type": "string"}
_OBJECT = {"type": "object"}
_TOKEN_IDS = {"type": "array", "items": _INTEGER}
_NULLABLE_OBJECT = {"type": ["object", "null"]}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": _json(_ref("ErrorResponse"), "Bad request: the message names the field"),
    "403": _json(_ref("ErrorResponse"), "Scale-out routes off (no --enable-scale-out)"),
    "404": _json(_ref("ErrorResponse"), "Unknown model"),
}


def _operation(summary: str, body: str, answer: dict[str, Any]) -> dict[str, Any]:
    return {
        "summary": f"{summary} (--enable-scale-out or --tokens-only)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
        "responses": {"200": _json(answer, "OK"), **_ERRORS},
    }


SCALE_OUT_SCHEMAS: dict[str, dict[str, Any]] = {
    "GenerateRequest": {
        "type": "object",
        "description": "A prompt as token ids with vLLM's SamplingParams (what /render gives).",
        "required": ["token_ids", "sampling_params"],
        "properties": {
            "request_id": _STRING,
            "token_ids": _TOKEN_IDS,
            "sampling_params": _OBJECT,
            "model": {"type": ["string", "null"]},
            "stream": {"type": ["boolean", "null"]},
            "stream_options": _NULLABLE_OBJECT,
            "return_token_ids": {"type": ["boolean", "null"]},
            "output_mode": {"enum": ["tokens", "text"]},
            "cache_salt": {"type": ["string", "null"]},
            "priority": _INTEGER,
        },
    },
    "GenerateResponse": {
        "type": "object",
        "properties": {
            "request_id": _STRING,
            "model": _STRING,
            "created": _INTEGER,
            "output_mode": {"enum": ["tokens", "text"]},
            "choices": {"type": "array", "items": _OBJECT},
            "usage": _OBJECT,
            "prompt_token_ids": {"type": ["array", "null"], "items": _INTEGER},
        },
    },
    "AbortRequestsRequest": {
        "type": "object",
        "required": ["request_ids"],
        "properties": {"request_ids": {"type": "array", "items": _STRING}},
    },
    "DerenderChatRequest": {
        "type": "object",
        "description": "A generate response (stream=false) or one of its SSE chunks with "
        "the state the call before answered (stream=true), to turn back into chat's answer.",
        "properties": {
            "stream": {"type": "boolean"},
            "model": {"type": ["string", "null"]},
            "generate_response": _ref("GenerateResponse"),
            "generate_chunk": _ref("GenerateResponse"),
            "stream_state": _ref("DerenderStreamState"),
            "prompt_tokens": {"type": ["integer", "null"]},
            "prompt_token_ids": {"type": ["array", "null"], "items": _INTEGER},
            "chat_request": _NULLABLE_OBJECT,
        },
    },
    "DerenderCompletionRequest": {
        "type": "object",
        "description": "Generate responses, one per prompt (stream=false), or one SSE chunk "
        "with the state the call before answered (stream=true).",
        "properties": {
            "stream": {"type": "boolean"},
            "model": {"type": ["string", "null"]},
            "generate_responses": {"type": "array", "items": _ref("GenerateResponse")},
            "generate_chunk": _ref("GenerateResponse"),
            "stream_state": _ref("DerenderStreamState"),
            "prompt_tokens": {"type": ["array", "integer", "null"]},
            "prompt_token_ids": {"type": ["array", "null"]},
            "completion_request": _NULLABLE_OBJECT,
        },
    },
    "DerenderStreamState": {
        "type": ["object", "null"],
        "description": "What a streamed derender carries to its next call, as answered.",
        "properties": {
            "prev_tokens": {"type": "array", "items": _STRING},
            "prefix_offset": _INTEGER,
            "read_offset": _INTEGER,
            "role_sent": {"type": "boolean"},
            "logprob_context_token_ids": _TOKEN_IDS,
            "logprob_text_offset": _INTEGER,
            "output_token_ids": _TOKEN_IDS,
            "output_chunk_lens": _TOKEN_IDS,
            "tools_streamed": {"type": "boolean"},
            "last_tool_call_ids": {"type": "array", "items": _STRING},
        },
    },
    "DerenderStreamResponse": {
        "type": "object",
        "properties": {"chunk": _OBJECT, "stream_state": _ref("DerenderStreamState")},
    },
}

SCALE_OUT_OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/completions/render"): _operation(
        "A completions request as token ids and sampling params, one per prompt",
        "CompletionRequest",
        {"type": "array", "items": _ref("GenerateRequest")},
    ),
    ("post", "/v1/chat/completions/render"): _operation(
        "A chat request as token ids (the chat template applied) and sampling params",
        "ChatCompletionRequest",
        _ref("GenerateRequest"),
    ),
    ("post", "/v1/messages/render"): _operation(
        "An Anthropic Messages request as token ids and sampling params",
        "AnthropicMessagesRequest",
        _ref("GenerateRequest"),
    ),
    ("post", "/v1/responses/render"): _operation(
        "A Responses request as token ids and sampling params",
        "ResponsesRequest",
        _ref("GenerateRequest"),
    ),
    ("post", "/v1/chat/completions/derender"): _operation(
        "A generate response as a chat completion, or one SSE chunk as a chat chunk",
        "DerenderChatRequest",
        {"oneOf": [_ref("ChatCompletionResponse"), _ref("DerenderStreamResponse")]},
    ),
    ("post", "/v1/completions/derender"): _operation(
        "Generate responses as a completion, or one SSE chunk as a completion chunk",
        "DerenderCompletionRequest",
        {"oneOf": [_ref("CompletionResponse"), _ref("DerenderStreamResponse")]},
    ),
    ("post", "/inference/v1/generate"): {
        **_operation(
            "Tokens in, tokens out (SSE with stream=true)",
            "GenerateRequest",
            _ref("GenerateResponse"),
        ),
    },
    ("post", "/inference/v1/abort_requests"): {
        **_operation("Abort requests by id", "AbortRequestsRequest", _OBJECT),
        "responses": {"200": {"description": "Aborting (empty body)"}, **_ERRORS},
    },
}
"""/openapi.json's operations of the scale-out routes."""
