"""/openapi.json's operations and schemas of the scale-out routes (scale_out.py), in the
shapes of vLLM 0.32's GenerateRequest and GenerateTokensResponse
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


_NOT_SERVED = {
    "501": _json(_ref("ErrorResponse"), "Not served by aioserve yet"),
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
    "ScaleOutRequest": {
        "type": "object",
        "description": "The body of the route this path renders or derenders.",
        "properties": {"model": _STRING},
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
"""/openapi.json's operations of the scale-out routes aioserve serves."""

for _path in (
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
):
    SCALE_OUT_OPERATIONS["post", _path] = {
        "summary": "vLLM's scale-out route, not served by aioserve yet (501)",
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref("ScaleOutRequest")}},
        },
        "responses": {"200": {"description": "Never: 501"}, **_ERRORS, **_NOT_SERVED},
    }
