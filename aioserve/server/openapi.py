"""GET /openapi.json (an OpenAPI 3.1 description of every route) and GET /docs (a page showing it).

The operations are written by hand, concisely: each route's purpose, its request body's
fields with their types (for completions and chat, the declarations protocol.py reads
bodies by: request_schema.py), and its response. `openapi_document` lists the operations of the
routes the app has (GET /load only with --enable-server-load-tracking); the schema and
docs pages themselves are not listed, as in FastAPI. Both pages are left out with
--disable-fastapi-docs. The docs page (docs_page.py) is self-contained (no CDN): it reads
the schema and renders each operation with its fields.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from aioserve import __version__
from aioserve.server.anthropic_api import ANTHROPIC_OPERATIONS, ANTHROPIC_SCHEMAS
from aioserve.server.classify import CLASSIFY_BODY
from aioserve.server.docs_page import docs_page
from aioserve.server.embeddings import EMBEDDING_BODY, POOLING_BODY
from aioserve.server.pause_routes import PAUSE_OPERATIONS
from aioserve.server.request_schema import CHAT_BODY, COMPLETION_BODY, properties
from aioserve.server.scale_out_schema import SCALE_OUT_OPERATIONS, SCALE_OUT_SCHEMAS
from aioserve.server.scoring import RERANK_BODY, SCORE_BODY
from aioserve.server.sleep_routes import SLEEP_ROUTE_OPERATIONS


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(schema_name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(schema_name)}}}


_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
_OBJECT = {"type": "object"}
_NULL = {"type": "null"}
_TOKEN_IDS = {"type": "array", "items": _INTEGER}
_ERRORS = {
    "400": _json(_ref("ErrorResponse"), "Bad request: the message names the field and value"),
    "404": _json(_ref("ErrorResponse"), "Unknown model"),
    "503": _json(_ref("ErrorResponse"), "The server is draining"),
}
_AUTH_ERROR = {"401": _json(_ref("ErrorResponse"), "Missing or wrong API key (--api-key)")}
_EMPTY_OK = {"200": {"description": "Healthy (empty body)"}, "503": _ERRORS["503"]}
_TEXT_OK = {
    "description": "Done: a line of plain text",
    "content": {"text/plain": {"schema": _STRING}},
}

_NUMBER = {"type": "number"}
_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": _INTEGER,
        "completion_tokens": _INTEGER,
        "total_tokens": _INTEGER,
        "prompt_tokens_details": {"type": ["object", "null"]},
    },
}


def _list_answer(item: dict[str, Any], description: str | None = None) -> dict[str, Any]:
    """A pooling route's answer: {"id", "object": "list", "created", "model", "data": one
    `item` (its properties) per input, "usage"}."""
    answer: dict[str, Any] = {
        "type": "object",
        "properties": {
            "id": _STRING,
            "object": {"const": "list"},
            "created": _INTEGER,
            "model": _STRING,
            "data": {"type": "array", "items": {"type": "object", "properties": item}},
            "usage": _USAGE,
        },
    }
    if description is not None:
        answer["description"] = description
    return answer


def _pooling_list(item_object: str, item_key: str) -> dict[str, Any]:
    """The answer of /v1/embeddings or /pooling: one vector per input."""
    vector = {"oneOf": [{"type": "array", "items": _NUMBER}, _STRING]}
    return _list_answer(
        {"index": _INTEGER, "object": {"const": item_object}, item_key: vector},
        "With encoding_format bytes or bytes_only: an application/octet-stream body of the "
        "vectors' bytes (bytes: described in a `metadata` header).",
    )


_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": _STRING,
                    "type": _STRING,
                    "param": {"type": ["string", "null"]},
                    "code": _INTEGER,
                },
            }
        },
    },
    "LoadLoRAAdapterRequest": {
        "type": "object",
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": _STRING,
            "lora_path": _STRING,
            "load_inplace": {"type": "boolean"},
        },
    },
    "UnloadLoRAAdapterRequest": {
        "type": "object",
        "required": ["lora_name"],
        "properties": {"lora_name": _STRING},
    },
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": _STRING,
                        "object": {"const": "model"},
                        "created": _INTEGER,
                        "owned_by": _STRING,
                        "root": _STRING,
                        # A LoRA adapter's: its base model, and no context of its own.
                        "parent": {"type": ["string", "null"]},
                        "max_model_len": {"type": ["integer", "null"]},
                        "permission": {"type": "array", "items": _OBJECT},
                    },
                },
            },
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": properties(COMPLETION_BODY),
    },
    "CompletionResponse": {
        "type": "object",
        "description": "With stream=true: text/event-stream of `data: {chunk}` events, then "
        "`data: [DONE]`.",
        "properties": {
            "id": _STRING,
            "object": {"const": "text_completion"},
            "created": _INTEGER,
            "model": _STRING,
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INTEGER,
                        "text": _STRING,
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": {"type": ["string", "null"]},
                        "stop_reason": {"type": ["string", "integer", "null"]},
                    },
                },
            },
            "usage": _USAGE,
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": properties(CHAT_BODY),
    },
    "ChatCompletionResponse": {
        "type": "object",
        "description": "With stream=true: text/event-stream of `data: {chunk}` events (the "
        "first carries the role), then `data: [DONE]`.",
        "properties": {
            "id": _STRING,
            "object": {"const": "chat.completion"},
            "created": _INTEGER,
            "model": _STRING,
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INTEGER,
                        "message": {
                            "type": "object",
                            "properties": {"role": _STRING, "content": _STRING},
                        },
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": {"type": ["string", "null"]},
                    },
                },
            },
            "usage": _USAGE,
        },
    },
    "ResponsesRequest": {
        "type": "object",
        "required": ["input"],
        "description": "OpenAI's Responses API for text and function tools (other tools, "
        "output logprobs and prompt templates are refused; nothing is stored).",
        "properties": {
            "model": _STRING,
            "input": {
                "description": "A string, or message items: role and content (a string or "
                "input_text/output_text parts).",
                "type": ["string", "array"],
            },
            "instructions": _STRING,
            "max_output_tokens": _INTEGER,
            "temperature": {"type": "number"},
            "top_p": {"type": "number"},
            "top_k": _INTEGER,
            "min_p": {"type": "number"},
            "presence_penalty": {"type": "number"},
            "frequency_penalty": {"type": "number"},
            "text": {"type": "object", "description": "format: text, json_object or json_schema"},
            "tools": {"type": "array", "items": _OBJECT, "description": "function tools"},
            "tool_choice": {"description": "auto, none, required or {type: function, name}"},
            "stream": {"type": "boolean", "default": False},
            "store": {"type": "boolean", "description": "Accepted; nothing is stored."},
            "metadata": _OBJECT,
            "user": _STRING,
        },
    },
    "ResponsesResponse": {
        "type": "object",
        "description": "With stream=true: text/event-stream of named events (`event: <type>`, "
        "`data: {event}`), response.created first and response.completed last.",
        "properties": {
            "id": _STRING,
            "object": {"const": "response"},
            "created_at": _INTEGER,
            "model": _STRING,
            "status": {"enum": ["completed", "incomplete"]},
            "output": {"type": "array", "items": _OBJECT},
            "usage": _OBJECT,
        },
    },
    **ANTHROPIC_SCHEMAS,
    **SCALE_OUT_SCHEMAS,
    "TokenizeRequest": {
        "type": "object",
        "description": "Either prompt or messages.",
        "properties": {
            "model": _STRING,
            "prompt": _STRING,
            "messages": {"type": "array", "items": _OBJECT},
            "add_special_tokens": {
                "type": "boolean",
                "description": "Default: true for prompt, false for messages.",
            },
            "add_generation_prompt": {"type": "boolean", "default": True},
            "continue_final_message": {"type": "boolean", "default": False},
            "chat_template": _STRING,
            "chat_template_kwargs": _OBJECT,
            "return_token_strs": {"type": "boolean", "default": False},
        },
    },
    "TokenizeResponse": {
        "type": "object",
        "properties": {
            "count": _INTEGER,
            "max_model_len": _INTEGER,
            "tokens": _TOKEN_IDS,
            "token_strs": {"type": ["array", "null"], "items": _STRING},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "properties": {"model": _STRING, "tokens": _TOKEN_IDS},
    },
    "DetokenizeResponse": {"type": "object", "properties": {"prompt": _STRING}},
    "EmbeddingRequest": {
        "type": "object",
        "description": "Either input or messages (a chat, rendered with the chat template).",
        "properties": properties(EMBEDDING_BODY),
    },
    "EmbeddingResponse": _pooling_list("embedding", "embedding"),
    "PoolingRequest": {
        "type": "object",
        "description": "Either input or messages (a chat, rendered with the chat template).",
        "properties": properties(POOLING_BODY),
    },
    "PoolingResponse": _pooling_list("pooling", "data"),
    "ClassificationRequest": {
        "type": "object",
        "description": "Either input or messages (a chat, rendered with the chat template).",
        "properties": properties(CLASSIFY_BODY),
    },
    "ClassificationResponse": _list_answer(
        {
            "index": _INTEGER,
            "label": {"type": ["string", "null"]},
            "probs": {"type": "array", "items": _NUMBER},
            "num_classes": _INTEGER,
        }
    ),
    "ScoreRequest": {
        "type": "object",
        "description": "Two sides: queries and documents (or queries and items, data_1 and "
        "data_2, text_1 and text_2); 1:1, 1:N or N:N.",
        "properties": properties(SCORE_BODY),
    },
    "ScoreResponse": _list_answer(
        {"index": _INTEGER, "object": {"const": "score"}, "score": _NUMBER}
    ),
    "RerankRequest": {
        "type": "object",
        "required": ["query", "documents"],
        "properties": properties(RERANK_BODY),
    },
    "RerankResponse": {
        "type": "object",
        "properties": {
            "id": _STRING,
            "model": _STRING,
            "usage": {
                "type": "object",
                "properties": {"prompt_tokens": _INTEGER, "total_tokens": _INTEGER},
            },
            "results": {
                "type": "array",
                "description": "By relevance, best first; top_n of them (0: all).",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INTEGER,
                        "document": {
                            "type": "object",
                            "properties": {"text": _STRING, "multi_modal": _NULL},
                        },
                        "relevance_score": _NUMBER,
                    },
                },
            },
        },
    },
}

# (method, path) -> operation
_OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/completions"): {
        "summary": "Complete a prompt (OpenAI's legacy completions; streams with stream=true)",
        "requestBody": _body("CompletionRequest"),
        "responses": {"200": _json(_ref("CompletionResponse")), **_ERRORS, **_AUTH_ERROR},
    },
    ("post", "/v1/chat/completions"): {
        "summary": "Answer chat messages, rendered with the chat template (streams with "
        "stream=true)",
        "requestBody": _body("ChatCompletionRequest"),
        "responses": {"200": _json(_ref("ChatCompletionResponse")), **_ERRORS, **_AUTH_ERROR},
    },
    ("post", "/v1/responses"): {
        "summary": "Answer a Responses API request: one chat turn (streams with stream=true)",
        "requestBody": _body("ResponsesRequest"),
        "responses": {"200": _json(_ref("ResponsesResponse")), **_ERRORS, **_AUTH_ERROR},
    },
    **ANTHROPIC_OPERATIONS,
    **SCALE_OUT_OPERATIONS,
    ("get", "/v1/responses/{response_id}"): {
        "summary": "A stored response: aioserve stores none, so always 404",
        "responses": {"200": _json(_ref("ResponsesResponse")), "404": _ERRORS["404"]},
    },
    ("post", "/v1/responses/{response_id}/cancel"): {
        "summary": "Cancel a stored background response: aioserve stores none, so always 404",
        "responses": {"200": _json(_ref("ResponsesResponse")), "404": _ERRORS["404"]},
    },
    ("get", "/v1/models"): {
        "summary": "The served model names (the first is the one responses report)",
        "responses": {"200": _json(_ref("ModelList")), **_AUTH_ERROR},
    },
    ("post", "/v1/load_lora_adapter"): {
        "summary": "Serve a LoRA adapter under a model name of its own "
        "(VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
        "requestBody": _body("LoadLoRAAdapterRequest"),
        "responses": {"200": _TEXT_OK, **_ERRORS, **_AUTH_ERROR},
    },
    ("post", "/v1/unload_lora_adapter"): {
        "summary": "Stop serving a LoRA adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
        "requestBody": _body("UnloadLoRAAdapterRequest"),
        "responses": {"200": _TEXT_OK, **_ERRORS, **_AUTH_ERROR},
    },
    ("get", "/health"): {"summary": "200 while the server can serve", "responses": _EMPTY_OK},
    ("get", "/ping"): {"summary": "The same as /health", "responses": _EMPTY_OK},
    ("post", "/ping"): {"summary": "The same as /health", "responses": _EMPTY_OK},
    ("get", "/version"): {
        "summary": "The aioserve version",
        "responses": {"200": _json({"type": "object", "properties": {"version": _STRING}})},
    },
    ("get", "/load"): {
        "summary": "Requests in flight (--enable-server-load-tracking)",
        "responses": {"200": _json({"type": "object", "properties": {"server_load": _INTEGER}})},
    },
    ("post", "/tokenize"): {
        "summary": "Token ids of a prompt, or of chat messages through the chat template",
        "requestBody": _body("TokenizeRequest"),
        "responses": {"200": _json(_ref("TokenizeResponse")), **_ERRORS},
    },
    ("post", "/detokenize"): {
        "summary": "Text of a list of token ids",
        "requestBody": _body("DetokenizeRequest"),
        "responses": {"200": _json(_ref("DetokenizeResponse")), **_ERRORS},
    },
    ("get", "/tokenizer_info"): {
        "summary": "The tokenizer's configuration, class and --chat-template "
        "(--enable-tokenizer-info-endpoint)",
        "responses": {
            "200": _json(
                {"type": "object", "properties": {"tokenizer_class": _STRING}},
            ),
            **_ERRORS,
        },
    },
    ("post", "/v1/embeddings"): {
        "summary": "Embed texts, token ids or chats (a pooling model)",
        "requestBody": _body("EmbeddingRequest"),
        "responses": {"200": _json(_ref("EmbeddingResponse")), **_ERRORS, **_AUTH_ERROR},
    },
    ("post", "/pooling"): {
        "summary": "The pooled vectors of texts, token ids or chats (a pooling model)",
        "requestBody": _body("PoolingRequest"),
        "responses": {"200": _json(_ref("PoolingResponse")), **_ERRORS, **_AUTH_ERROR},
    },
    ("post", "/classify"): {
        "summary": "Class scores and labels of texts, token ids or chats (a classifier)",
        "requestBody": _body("ClassificationRequest"),
        "responses": {"200": _json(_ref("ClassificationResponse")), **_ERRORS, **_AUTH_ERROR},
    },
    **{
        ("post", path): {
            "summary": "Score text pairs: the cosine similarity of their embeddings, or a "
            "cross-encoder's score of each pair",
            "requestBody": _body("ScoreRequest"),
            "responses": {"200": _json(_ref("ScoreResponse")), **_ERRORS, **_AUTH_ERROR},
        }
        for path in ("/score", "/v1/score")
    },
    **{
        ("post", path): {
            "summary": "Rank documents by their relevance to a query (embedding cosine, or "
            "a cross-encoder's score)",
            "requestBody": _body("RerankRequest"),
            "responses": {"200": _json(_ref("RerankResponse")), **_ERRORS, **_AUTH_ERROR},
        }
        for path in ("/rerank", "/v1/rerank", "/v2/rerank")
    },
    ("post", "/invocations"): {
        "summary": "SageMaker's route: a body of any kind the model takes, answered by that "
        "kind's route (chat or completion; embeddings, classify, rerank or score)",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "oneOf": [
                            _ref(name)
                            for name in (
                                "ChatCompletionRequest",
                                "CompletionRequest",
                                "EmbeddingRequest",
                                "ClassificationRequest",
                                "RerankRequest",
                                "ScoreRequest",
                            )
                        ]
                    }
                }
            },
        },  # fmt: skip
        "responses": {
            "200": {"description": "The answer of the kind's route (JSON, or its stream)"},
            **_ERRORS,
            **_AUTH_ERROR,
        },
    },
    **{
        ("post", path): {
            "summary": f"{verb} torch's profiler over the engine's steps "
            "(VLLM_TORCH_PROFILER_DIR; local development only)",
            "responses": {"200": {"description": "Done (empty body)"}, **_ERRORS, **_AUTH_ERROR},
        }
        for path, verb in (
            ("/start_profile", "Start"),
            ("/stop_profile", "Stop, writing the trace of"),
        )
    },
    ("post", "/reset_prefix_cache"): {
        "summary": "Forget the cached prefix blocks (VLLM_SERVER_DEV_MODE=1): success false "
        "while requests hold blocks",
        "responses": {
            "200": _json({"type": "object", "properties": {"success": {"type": "boolean"}}}),
            **_ERRORS,
            **_AUTH_ERROR,
        },
    },
    ("get", "/server_info"): {
        "summary": "The server's configuration, its VLLM_* variables and its environment "
        "(VLLM_SERVER_DEV_MODE=1; secrets left out)",
        "parameters": [
            {
                "name": "config_format",
                "in": "query",
                "schema": {"enum": ["text", "json"], "default": "text"},
            }
        ],
        "responses": {
            "200": _json(
                {
                    "type": "object",
                    "properties": {
                        "vllm_config": {"type": ["string", "object"]},
                        "vllm_env": {"type": "object"},
                        "system_env": {"type": "object"},
                    },
                }
            ),
            **_ERRORS,
            **_AUTH_ERROR,
        },
    },
    **PAUSE_OPERATIONS,
    **SLEEP_ROUTE_OPERATIONS,
    ("get", "/metrics"): {
        "summary": "Prometheus metrics, with vLLM's names",
        "responses": {
            "200": {
                "description": "The Prometheus text exposition format",
                "content": {"text/plain": {"schema": _STRING}},
            }
        },
    },
}

DOCS_PATHS = frozenset({"/openapi.json", "/docs"})


def openapi_document(app: web.Application, root_path: str | None) -> dict[str, Any]:
    """The OpenAPI document of the routes registered on `app` (HEAD and the docs left out)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        key = (route.method.lower(), path)
        if key in _OPERATIONS:
            paths.setdefault(path, {})[key[0]] = _OPERATIONS[key]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "aioserve",
            "version": __version__,
            "description": "An OpenAI-compatible LLM server with vLLM's API.",
        },
        "servers": [{"url": root_path or "/"}],
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def add_docs_routes(app: web.Application, root_path: str | None) -> None:
    """Register GET /openapi.json and GET /docs."""

    async def openapi_json(request: web.Request) -> web.Response:
        return web.json_response(openapi_document(request.app, root_path))

    async def docs(request: web.Request) -> web.Response:
        page = docs_page(f"{root_path or ''}/openapi.json")
        return web.Response(text=page, content_type="text/html")

    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/docs", docs)
