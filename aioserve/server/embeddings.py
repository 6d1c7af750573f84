"""POST /v1/embeddings and POST /pooling: texts, token ids or chats in, one vector each out.

As vLLM 0.32 serves a pooling model (entrypoints/pooling/embed/ and pooling/; the answers
recorded in tests/server/vllm_samples 40-94):

- `input` is a string, an array of strings, an array of token ids or an array of token id
  arrays, each one prompt (an empty string is a prompt too: the tokenizer's special tokens);
  `add_special_tokens` defaults to true. An array of chat messages as `input`, or
  `messages` (one conversation, or an array of them), is rendered with the chat template as
  chat does (chat_template.py: `add_generation_prompt` defaults to false here,
  `add_special_tokens` to false).
- `encoding_format`: "float" (numbers), "base64" (the vector's raw bytes: `embed_dtype`,
  float32 by default, in `endianness`, native by default, which is what the openai client
  decodes), or "bytes" / "bytes_only" (an application/octet-stream body of every vector's
  bytes one after the other; "bytes" describes them in a `metadata` header).
- `dimensions` cuts a matryoshka model's vector (the engine refuses it for other models);
  `use_activation` false skips the L2 normalization. /pooling refuses `dimensions` and
  takes `task`: only the model's own is served ("embed", or "classify" for a sequence
  classifier, whose /pooling vector is its class scores, activated unless
  `use_activation` is false).
- The answer: {"id": "embd-<id>" (/pooling: "pooling-<id>"), "object": "list", "created",
  "model", "data": [{"index", "object": "embedding" | "pooling", "embedding" | "data"}],
  "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0, null details}}.

`add_embedding_routes` registers these and the scoring routes (scoring.py) for an embedding
model; pooling_routes.py picks the routes of the served model's task.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch
from aiohttp import web

from aioserve.engine.outputs import PoolingRequestOutput
from aioserve.engine.pooling_params import PoolingParams
from aioserve.server.body_fields import BodyFields, log_ignored_fields, read_json_body, shown_value
from aioserve.server.chat_template import (
    BOTH_GENERATION_FLAGS,
    refuse_request_template,
    render_chat,
)
from aioserve.server.errors import APIError, bad_parameter, refusal
from aioserve.server.generation import reserve_places
from aioserve.server.pooling_requests import (
    COMMON_BODY,
    PoolingRequest,
    Prompt,
    checked_prompts,
    encode_all,
    pooling_task,
    pooling_usage,
    read_pooling_request,
    tokenize_texts,
)
from aioserve.server.protocol import check_serving
from aioserve.server.request_schema import BodyField
from aioserve.server.responses import ResponseHead
from aioserve.server.scoring import add_scoring_routes
from aioserve.server.state import STATE, ServerState

ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")
# embed_dtype: (the dtype the vector is cast to, the dtype its bytes are read as), vLLM's.
EMBED_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.float16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}
ENDIANNESS = ("native", "big", "little")
_POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify", "plugin")
"""vLLM's tasks; /pooling serves the model's own (embed or classify; vLLM also has
token_embed for an embedding model, token_classify for a classifier)."""

_STRING = {"type": "string"}
_BOOLEAN = {"type": "boolean"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer"}}
_MESSAGES = {"type": "array", "items": {"type": "object"}}

EMBEDDING_BODY: dict[str, BodyField] = {
    **COMMON_BODY,
    **{
        field.name: field
        for field in (
            BodyField(
                "input",
                {
                    "oneOf": [
                        _STRING,
                        {"type": "array", "items": _STRING},
                        _TOKEN_IDS,
                        {"type": "array", "items": _TOKEN_IDS},
                        _MESSAGES,
                    ]
                },
            ),
            BodyField("messages", {"oneOf": [_MESSAGES, {"type": "array", "items": _MESSAGES}]}),
            BodyField("add_special_tokens", _BOOLEAN),
            BodyField("add_generation_prompt", _BOOLEAN),
            BodyField("continue_final_message", _BOOLEAN),
            BodyField("chat_template_kwargs", {"type": "object"}),
            BodyField("encoding_format", {"type": "string", "enum": list(ENCODING_FORMATS)}),
            BodyField("embed_dtype", {"type": "string", "enum": list(EMBED_DTYPES)}),
            BodyField("endianness", {"type": "string", "enum": list(ENDIANNESS)}),
            BodyField("dimensions", {"type": "integer"}),
        )
    },
}
"""The /v1/embeddings body; `input` and `messages` are read by this module's own code."""
POOLING_BODY: dict[str, BodyField] = {
    **EMBEDDING_BODY,
    "task": BodyField("task", {"type": "string", "enum": list(_POOLING_TASKS)}),
}

# The fields of vLLM 0.32's request models (for logging the others, as vLLM does):
# EmbeddingCompletionRequest / EmbeddingChatRequest, PoolingCompletionRequest /
# PoolingChatRequest, sorted({n for f, i in M.model_fields.items() for n in (f, i.alias) if n}).
ENCODING_FIELDS = frozenset({"dimensions", "embed_dtype", "encoding_format", "endianness"})
POOLING_BASE_FIELDS = ENCODING_FIELDS | {
    "cache_salt", "mm_processor_kwargs", "model", "padding", "priority", "request_id",
    "truncate_prompt_tokens", "truncation_side", "use_activation", "user", "add_special_tokens",
}  # fmt: skip
CHAT_FIELDS = frozenset(
    {
        "messages", "add_generation_prompt", "continue_final_message", "chat_template",
        "chat_template_kwargs", "media_io_kwargs",
    }
)  # fmt: skip
EMBEDDING_COMPLETION_FIELDS = POOLING_BASE_FIELDS | {"input"}
EMBEDDING_CHAT_FIELDS = POOLING_BASE_FIELDS | CHAT_FIELDS
POOLING_COMPLETION_FIELDS = EMBEDDING_COMPLETION_FIELDS | {"task"}
POOLING_CHAT_FIELDS = EMBEDDING_CHAT_FIELDS | {"task"}


@dataclass
class PoolingInputs:
    """A body's prompts: plain ones (texts, token id lists) or chat conversations."""

    prompts: list[str | list[int]] = field(default_factory=list)
    conversations: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def chat(self) -> bool:
        return bool(self.conversations)

    def __len__(self) -> int:
        return len(self.conversations) if self.chat else len(self.prompts)


@dataclass(frozen=True)
class Encoding:
    """How vectors are written: `encoding_format`, `embed_dtype`, `endianness`."""

    format: str = "float"
    embed_dtype: str = "float32"
    endianness: str = "native"

    def raw(self, vector: torch.Tensor) -> bytes:
        """The vector's bytes in `embed_dtype` and `endianness` (vLLM's tensor2binary)."""
        cast, view = EMBED_DTYPES[self.embed_dtype]
        array = vector.detach().to("cpu").flatten().to(cast).contiguous().view(view).numpy()
        if self.endianness not in ("native", sys.byteorder):
            array = array.byteswap()
        return array.tobytes()

    def json_value(self, vector: torch.Tensor) -> list[float] | str:
        """The vector as a JSON answer shows it: numbers, or base64 of its bytes."""
        if self.format == "base64":
            return base64.b64encode(self.raw(vector)).decode("ascii")
        return vector.tolist()


@dataclass(frozen=True)
class _Route:
    prefix: str
    """Of the response id: "embd" or "pooling"."""
    item_object: str
    item_key: str
    body: dict[str, BodyField]
    completion_fields: frozenset[str]
    chat_fields: frozenset[str]
    check: Callable[[BodyFields, str], None]
    """The route's own checks of the body, given the model's pooling task."""


def read_inputs(body: dict[str, Any]) -> PoolingInputs:
    """The prompts of an embeddings or pooling body, or a 400 saying what is wrong."""
    value = body.get("input")
    if value is None:
        messages = body.get("messages")
        if messages is None:
            raise APIError("the field `input` (or `messages`) is required", param="input")
        if _is_conversation(messages):
            return PoolingInputs(conversations=[messages])
        if isinstance(messages, list) and messages and all(map(_is_conversation, messages)):
            return PoolingInputs(conversations=messages)
        raise bad_parameter(
            "messages",
            shown_value(messages),
            "messages must be a non-empty array of messages (or of conversations)",
        )
    if _is_conversation(value):
        return PoolingInputs(conversations=[value])
    if isinstance(value, list) and value and all(map(_is_conversation, value)):
        return PoolingInputs(conversations=value)
    if isinstance(value, str):
        return PoolingInputs(prompts=[value])
    if isinstance(value, list):
        if not value:
            raise APIError("You must pass at least one prompt", param="input")
        if all(_is_int(item) for item in value):
            return PoolingInputs(prompts=[value])
        if all(isinstance(item, str) for item in value) or all(
            isinstance(item, list) and all(_is_int(t) for t in item) for item in value
        ):
            return PoolingInputs(prompts=value)
    raise bad_parameter(
        "input",
        shown_value(value),
        "input must be a string, an array of strings, an array of token ids, an array of "
        "token id arrays or an array of chat messages",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_conversation(value: Any) -> bool:
    """A non-empty list of chat messages (objects with a string `role`), as vLLM tells."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def read_encoding(fields: BodyFields) -> Encoding:
    """`encoding_format`, `embed_dtype` and `endianness`, each one of vLLM's values."""
    values = {}
    for name, allowed, default in (
        ("encoding_format", ENCODING_FORMATS, "float"),
        ("embed_dtype", tuple(EMBED_DTYPES), "float32"),
        ("endianness", ENDIANNESS, "native"),
    ):
        value = fields.get(name, default)
        if value not in allowed:
            shown = ", ".join(f"'{a}'" for a in allowed)
            raise bad_parameter(name, shown_value(value), f"{name} must be one of {shown}")
        values[name] = value
    return Encoding(values["encoding_format"], values["embed_dtype"], values["endianness"])


async def tokenized_inputs(
    state: ServerState, inputs: PoolingInputs, fields: BodyFields, max_length: int | None = None
) -> list[Prompt]:
    """Every prompt's token ids: texts tokenized (cut by the tokenizer to `max_length`),
    chats rendered with the chat template."""
    body = fields.body
    if inputs.chat:
        add_generation_prompt = fields.get("add_generation_prompt", False)
        continue_final_message = fields.get("continue_final_message", False)
        if add_generation_prompt and continue_final_message:
            raise APIError(BOTH_GENERATION_FLAGS)
        kwargs = fields.get("chat_template_kwargs")
        chat_template = body.get("chat_template")
        refuse_request_template(
            chat_template, kwargs, trusted=state.frontend.trust_request_chat_template
        )
        prompts = []
        for conversation in inputs.conversations:
            text, token_ids = await state.off_loop(
                render_chat,
                state,
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=kwargs,
                add_special_tokens=fields.get("add_special_tokens", False),
                chat_template=chat_template,
            )
            prompts.append(Prompt(text, token_ids))
        return prompts
    texts = [p for p in inputs.prompts if isinstance(p, str)]
    add_special_tokens = fields.get("add_special_tokens", True)
    encoded = iter(await tokenize_texts(state, texts, add_special_tokens, max_length))
    return [
        Prompt(p, next(encoded), cut=max_length is not None)
        if isinstance(p, str)
        else Prompt(None, list(p))
        for p in inputs.prompts
    ]


def _check_pooling_task(fields: BodyFields, model_task: str) -> None:
    """/pooling's own checks (vLLM's ServingPooling._verify_pooling_task): no `dimensions`,
    and `task`, when given, the model's."""
    if fields.body.get("dimensions") is not None:
        raise refusal("dimensions is currently not supported", "dimensions")
    task = fields.get("task")
    if task is None and fields.body.get("input") is None and "data" in fields.body:
        task = "plugin"  # vLLM's IOProcessorRequest: a `data` body
    if task is None or task == model_task:
        return
    if task == "plugin":
        raise refusal(
            "No IOProcessor plugin installed. Please refer to the documentation and to the "
            "'prithvi_geospatial_mae_io_processor' offline inference example for more "
            "details.",
            "task",
        )
    if task in _POOLING_TASKS:
        raise refusal(f"Unsupported task: {task!r} Supported tasks: {[model_task]}", "task")
    raise bad_parameter(
        "task", shown_value(task), f"task must be one of {', '.join(_POOLING_TASKS)}"
    )


def _no_checks(fields: BodyFields, model_task: str) -> None:
    del fields, model_task


EMBEDDINGS_ROUTE = _Route(
    "embd",
    "embedding",
    "embedding",
    EMBEDDING_BODY,
    EMBEDDING_COMPLETION_FIELDS,
    EMBEDDING_CHAT_FIELDS,
    _no_checks,
)
POOLING_ROUTE = _Route(
    "pooling",
    "pooling",
    "data",
    POOLING_BODY,
    POOLING_COMPLETION_FIELDS,
    POOLING_CHAT_FIELDS,
    _check_pooling_task,
)


async def create_embedding(request: web.Request) -> web.Response:
    """The /v1/embeddings handler."""
    return await _pool(request, EMBEDDINGS_ROUTE)


async def create_pooling(request: web.Request) -> web.Response:
    """The /pooling handler."""
    return await _pool(request, POOLING_ROUTE)


async def _pool(request: web.Request, route: _Route) -> web.Response:
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    fields = BodyFields(body, route.body)
    common = read_pooling_request(state, fields, request.headers)
    task = pooling_task(state.engine)
    route.check(fields, task)
    encoding = read_encoding(fields)
    params = PoolingParams(
        dimensions=fields.get("dimensions"), task=task, use_activation=common.use_activation
    )
    inputs = read_inputs(body)
    log_ignored_fields(body, route.chat_fields if inputs.chat else route.completion_fields)
    head, outputs = await pool_inputs(state, inputs, fields, common, params, route.prefix)
    if encoding.format in ("bytes", "bytes_only"):
        return bytes_response(head, outputs, encoding)
    body = pooling_response(head, outputs, encoding, route.item_object, route.item_key)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def pool_inputs(
    state: ServerState,
    inputs: PoolingInputs,
    fields: BodyFields,
    common: PoolingRequest,
    params: PoolingParams,
    prefix: str,
) -> tuple[ResponseHead, list[PoolingRequestOutput]]:
    """The answer's head ("<prefix>-<request id>") and every input's output: places
    reserved, inputs tokenized and checked, then all run at once."""
    engine = state.engine
    head = ResponseHead.new(f"{prefix}-{common.request_id}", "list", state.model_name)
    with reserve_places(engine, len(inputs)) as reservation:
        prompts = await tokenized_inputs(state, inputs, fields, common.tokenizer_max_length)
        prompts = checked_prompts(engine, prompts, common.truncation, params)
        outputs = await encode_all(engine, prompts, params, head.id, common, reservation)
    return head, outputs


def pooling_response(
    head: ResponseHead,
    outputs: list[PoolingRequestOutput],
    encoding: Encoding,
    item_object: str = "embedding",
    item_key: str = "embedding",
) -> dict[str, Any]:
    """The JSON answer of /v1/embeddings (or, with "pooling" and "data", of /pooling)."""
    return {
        **head.fields(),
        "data": [
            {"index": i, "object": item_object, item_key: encoding.json_value(output.data)}
            for i, output in enumerate(outputs)
        ],
        "usage": pooling_usage(sum(len(o.prompt_token_ids) for o in outputs)),
    }


def bytes_response(
    head: ResponseHead, outputs: list[PoolingRequestOutput], encoding: Encoding
) -> web.Response:
    """The answer for encoding_format "bytes" (with a `metadata` header) or "bytes_only"."""
    chunks = [encoding.raw(output.data) for output in outputs]
    headers = {}
    if encoding.format == "bytes":
        items, offset = [], 0
        for i, (output, chunk) in enumerate(zip(outputs, chunks, strict=True)):
            items.append(
                {
                    "index": i,
                    "embed_dtype": encoding.embed_dtype,
                    "endianness": encoding.endianness,
                    "start": offset,
                    "end": offset + len(chunk),
                    "shape": list(output.data.shape),
                }
            )
            offset += len(chunk)
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        metadata = {
            "id": head.id,
            "created": head.created,
            "model": head.model,
            "data": items,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
        headers["metadata"] = json.dumps(metadata)
    return web.Response(
        body=b"".join(chunks), headers=headers, content_type="application/octet-stream"
    )


def add_embedding_routes(app: web.Application) -> None:
    """Register an embedding model's routes on `app`: /v1/embeddings, /pooling, and
    scoring.py's."""
    app.router.add_post("/v1/embeddings", create_embedding)
    app.router.add_post("/pooling", create_pooling)
    add_scoring_routes(app)
