"""POST /classify: a sequence classifier's class scores for texts, token ids or chats.

As vLLM 0.32 serves a classification model (entrypoints/pooling/classify/; the answers
recorded in tests/server/vllm_samples 100-160):

- the body is /v1/embeddings' without its encoding fields: `input` (a string, strings,
  token ids or lists of them; an empty string is [CLS][SEP]) or `messages` (rendered with
  the chat template), `add_special_tokens`, `use_activation`, and the pooling routes'
  common fields (truncate_prompt_tokens, truncation_side, request_id, priority, ...);
  fields of other routes (`dimensions`, `encoding_format`) are ignored, as vLLM ignores
  them;
- each prompt is one engine request "classify-<id>-<i>" with PoolingParams(task=
  "classify"): the engine answers the model's `num_labels` scores, activated as vLLM
  activates them (sigmoid for one label, softmax for more, or the config's) unless
  `use_activation` is false (the logits);
- the answer: {"id": "classify-<id>", "object": "list", "created", "model", "data":
  [{"index", "label", "probs", "num_classes"}], "usage": <as embeddings>}, `label` the
  config's id2label of the highest score (null when it has none).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from aioserve.engine.outputs import PoolingRequestOutput
from aioserve.engine.pooling_params import PoolingParams
from aioserve.server.body_fields import BodyFields, log_ignored_fields, read_json_body
from aioserve.server.embeddings import (
    CHAT_FIELDS,
    EMBEDDING_BODY,
    ENCODING_FIELDS,
    POOLING_BASE_FIELDS,
    pool_inputs,
    read_inputs,
)
from aioserve.server.pooling_requests import (
    COMMON_BODY,
    pooling_usage,
    read_pooling_request,
)
from aioserve.server.protocol import check_serving
from aioserve.server.request_schema import BodyField
from aioserve.server.responses import ResponseHead
from aioserve.server.state import STATE

CLASSIFY_BODY: dict[str, BodyField] = {
    **COMMON_BODY,
    **{
        name: EMBEDDING_BODY[name]
        for name in (
            "input",
            "messages",
            "add_special_tokens",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
        )
    },
}
"""The /classify body (vLLM's ClassificationCompletionRequest / ClassificationChatRequest)."""

# vLLM 0.32's request models' fields, for logging the others as vLLM does: the pooling
# routes' fields but the embedding encoding's.
CLASSIFY_COMPLETION_FIELDS = (POOLING_BASE_FIELDS - ENCODING_FIELDS) | {"input"}
CLASSIFY_CHAT_FIELDS = (POOLING_BASE_FIELDS - ENCODING_FIELDS) | CHAT_FIELDS


def label_of(id2label: Any, index: int) -> str | None:
    """The config's label of class `index` (keys as ints, or as strings in a raw
    config.json), None when it has none."""
    if not isinstance(id2label, dict):
        return None
    label = id2label.get(index, id2label.get(str(index)))
    return None if label is None else str(label)


def classification_data(index: int, probs: list[float], id2label: Any) -> dict[str, Any]:
    """One item of /classify's answer: the label of the highest score (the first of equal
    ones, as numpy's argmax), the scores, their number."""
    best = max(range(len(probs)), key=probs.__getitem__)
    return {
        "index": index,
        "label": label_of(id2label, best),
        "probs": probs,
        "num_classes": len(probs),
    }


def classification_response(
    head: ResponseHead, outputs: list[PoolingRequestOutput], id2label: Any
) -> dict[str, Any]:
    """/classify's answer (vLLM's ClassificationResponse, keys in its order)."""
    return {
        **head.fields(),
        "data": [
            classification_data(i, output.data.reshape(-1).tolist(), id2label)
            for i, output in enumerate(outputs)
        ],
        "usage": pooling_usage(sum(len(o.prompt_token_ids) for o in outputs)),
    }


async def create_classify(request: web.Request) -> web.Response:
    """The /classify handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    fields = BodyFields(body, CLASSIFY_BODY)
    common = read_pooling_request(state, fields, request.headers)
    params = PoolingParams(task="classify", use_activation=common.use_activation)
    inputs = read_inputs(body)
    log_ignored_fields(body, CLASSIFY_CHAT_FIELDS if inputs.chat else CLASSIFY_COMPLETION_FIELDS)
    head, outputs = await pool_inputs(state, inputs, fields, common, params, "classify")
    id2label = getattr(state.engine.hf_config, "id2label", None)
    answer = classification_response(head, outputs, id2label)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


def add_classify_routes(app: web.Application) -> None:
    """Register POST /classify on `app`."""
    app.router.add_post("/classify", create_classify)
