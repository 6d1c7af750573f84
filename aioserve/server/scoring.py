"""POST /score (/v1/score) and POST /rerank (/v1/rerank, /v2/rerank) on a pooling model.

As vLLM 0.32 scores (entrypoints/pooling/scoring/; the answers recorded in
tests/server/vllm_samples 55-89 for an embedding model, 100-149 for a cross-encoder), by
the served model's pooling task:

- an embedding model (a bi-encoder, BiEncoderIOProcessor): every text is embedded on its
  own (queries first, then documents, as engine requests "score-<id>-<i>"), and a pair's
  score is the cosine similarity of its two vectors; usage counts every text once (the
  query once, not once per pair);
- a sequence classifier of one label (a cross-encoder, CrossEncoderIOProcessor;
  cross_encoding.py): every (query, document) pair is one prompt, engine request
  "score-<id>-<i>", and its score is the model's activated logit (`use_activation: false`:
  the raw logit); usage counts every pair's tokens. A classifier of more labels has no
  scoring routes (404), as in vLLM.

- /score takes its two sides as `queries` and `documents` (or `queries` and `items`,
  `data_1` and `data_2`, `text_1` and `text_2`, the first pair present), each a string or
  an array of strings: one query scores every document (1:N), N queries score N documents
  pairwise (N:N). /rerank takes one `query`, `documents`, and `top_n` (0, the default: all).
- `max_tokens_per_query` / `max_tokens_per_doc` (0: off) cut a text to that many tokens
  before its special tokens are added; `truncate_prompt_tokens` cuts each prompt's tokens.
- /score answers {"id": "score-<id>", "object": "list", "created", "model", "data":
  [{"index", "object": "score", "score"}], "usage": <as embeddings>}; /rerank answers
  {"id": "score-<id>", "model", "usage": {"prompt_tokens", "total_tokens"}, "results":
  [{"index", "document": {"text", "multi_modal": null}, "relevance_score"}]}, the results
  by relevance, best first (documents of equal score in their order), top_n of them.
  vLLM's rerank has no `return_documents`: the documents are always returned.

Multimodal items ({"content": [...]}) are refused as vLLM refuses them for a text model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import torch
import torch.nn.functional as F
from aiohttp import web

from aioserve.engine.outputs import PoolingRequestOutput
from aioserve.engine.pooling_params import PoolingParams
from aioserve.server.body_fields import BodyFields, log_ignored_fields, read_json_body, shown_value
from aioserve.server.cross_encoding import encode_pairs, pair_score, truncate_text
from aioserve.server.errors import APIError, bad_parameter
from aioserve.server.generation import reserve_places
from aioserve.server.pooling_requests import (
    COMMON_BODY,
    Prompt,
    checked_prompts,
    encode_all,
    pooling_task,
    pooling_usage,
    read_pooling_request,
    tokenize_texts,
    tokenizer_of,
)
from aioserve.server.protocol import check_serving
from aioserve.server.request_schema import BodyField
from aioserve.server.responses import ResponseHead
from aioserve.server.state import STATE, ServerState

logger = logging.getLogger("aioserve.server")

# /score's pairs of sides, in the order vLLM's ScoreRequest union tries them.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))  # fmt: skip

_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
_SIDE = {"oneOf": [_STRING, {"type": "array", "items": _STRING}]}
_SCORING_BODY: dict[str, BodyField] = {
    **COMMON_BODY,
    "max_tokens_per_query": BodyField("max_tokens_per_query", {"type": "integer", "minimum": 0}),
    "max_tokens_per_doc": BodyField("max_tokens_per_doc", {"type": "integer", "minimum": 0}),
    "instruction": BodyField("instruction", _STRING),
    "chat_template_kwargs": BodyField("chat_template_kwargs", {"type": "object"}),
}
SCORE_BODY: dict[str, BodyField] = {
    **_SCORING_BODY,
    **{name: BodyField(name, _SIDE) for pair in SCORE_SIDES for name in pair},
}
RERANK_BODY: dict[str, BodyField] = {
    **_SCORING_BODY,
    "query": BodyField("query", _STRING),
    "documents": BodyField("documents", _SIDE),
    "top_n": BodyField("top_n", {"type": "integer", "minimum": 0, "default": 0}),
}

# The fields of vLLM 0.32's request models (ScoreQueriesDocumentsRequest, ...,
# RerankRequest), for logging the others as vLLM does.
_SCORING_FIELDS = frozenset(
    {
        "cache_salt", "chat_template_kwargs", "instruction", "max_tokens_per_doc",
        "max_tokens_per_query", "mm_processor_kwargs", "model", "padding", "priority",
        "request_id", "truncate_prompt_tokens", "truncation_side", "use_activation", "user",
    }
)  # fmt: skip
RERANK_FIELDS = _SCORING_FIELDS | {"query", "documents", "top_n"}


@dataclass
class ScoringInputs:
    """The texts to score: the first side (queries), then the second (documents)."""

    queries: list[str]
    documents: list[str]


def read_side(value: Any, name: str, architecture: str) -> list[str]:
    """One side of a scoring body as a list of texts; a multimodal item is refused as vLLM
    refuses it for a text model."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, dict) and "content" in item:
            raise APIError(f"MultiModalParam is not supported for {architecture}", param=name)
        if not isinstance(item, str):
            raise bad_parameter(
                name, shown_value(value), f"{name} must be a string or an array of strings"
            )
    return items


def check_side_lengths(queries: Sequence[str], documents: Sequence[str]) -> None:
    """vLLM's rule: 1:1, 1:N or N:N, and neither side empty."""
    if len(queries) > 1 and len(queries) != len(documents):
        raise APIError("Input lengths must be either 1:1, 1:N or N:N")
    if not queries:
        raise APIError("At least one text element must be given")
    if not documents:
        raise APIError("At least one text_pair element must be given")


def read_score_inputs(body: dict[str, Any], architecture: str) -> ScoringInputs:
    """/score's two sides: the first of SCORE_SIDES whose two fields are both given."""
    for first, second in SCORE_SIDES:
        if body.get(first) is not None and body.get(second) is not None:
            queries = read_side(body[first], first, architecture)
            documents = read_side(body[second], second, architecture)
            check_side_lengths(queries, documents)
            return ScoringInputs(queries, documents)
    raise APIError(
        "the request needs `queries` and `documents` (or `queries` and `items`, `data_1` "
        "and `data_2`, `text_1` and `text_2`)",
        param="queries",
    )


def read_rerank_inputs(body: dict[str, Any], architecture: str) -> ScoringInputs:
    """/rerank's `query` (one) and `documents`."""
    query, documents = body.get("query"), body.get("documents")
    if query is None:
        raise APIError("the field `query` is required", param="query")
    if documents is None:
        raise APIError("the field `documents` is required", param="documents")
    if isinstance(query, list):
        raise bad_parameter("query", shown_value(query), "query must be a string")
    inputs = ScoringInputs(
        read_side(query, "query", architecture), read_side(documents, "documents", architecture)
    )
    check_side_lengths(inputs.queries, inputs.documents)
    return inputs


def read_token_limit(fields: BodyFields, name: str, max_model_len: int) -> int:
    """`max_tokens_per_query` or `max_tokens_per_doc`: 0 (off) or less than the context."""
    value = fields.get(name, 0)
    if value < 0:
        raise bad_parameter(name, value, f"{name} must be a non-negative integer")
    if value >= max_model_len:
        raise bad_parameter(
            name, value, f"{name} ({value}) must be less than max_model_len ({max_model_len})."
        )
    return value


def pair_scores(
    query_vectors: Sequence[torch.Tensor], document_vectors: Sequence[torch.Tensor]
) -> list[float]:
    """The cosine similarity of each (query, document) pair: one query against every
    document, or the i-th against the i-th."""
    if len(query_vectors) == 1:
        query_vectors = list(query_vectors) * len(document_vectors)
    return [
        F.cosine_similarity(q.float(), d.float(), dim=0).item()
        for q, d in zip(query_vectors, document_vectors, strict=True)
    ]


def score_response(head: ResponseHead, scores: list[float], num_tokens: int) -> dict[str, Any]:
    """/score's answer."""
    return {
        **head.fields(),
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": pooling_usage(num_tokens),
    }


def rerank_response(
    head: ResponseHead, documents: list[str], scores: list[float], top_n: int, num_tokens: int
) -> dict[str, Any]:
    """/rerank's answer: the documents by relevance, best first, `top_n` of them (0: all)."""
    results = [
        {"index": i, "document": {"text": text, "multi_modal": None}, "relevance_score": score}
        for i, (text, score) in enumerate(zip(documents, scores, strict=True))
    ]
    results.sort(key=lambda result: result["relevance_score"], reverse=True)
    if 0 < top_n < len(results):
        results = results[:top_n]
    return {
        "id": head.id,
        "model": head.model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }


async def create_score(request: web.Request) -> web.Response:
    """The /score handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    fields = BodyFields(body, SCORE_BODY)
    inputs = read_score_inputs(body, _architecture(state))
    pair = next(p for p in SCORE_SIDES if body.get(p[0]) is not None and body.get(p[1]) is not None)
    log_ignored_fields(body, _SCORING_FIELDS | set(pair))
    head, scores, num_tokens = await _score(state, request, fields, inputs)
    answer = score_response(head, scores, num_tokens)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def create_score_v1(request: web.Request) -> web.Response:
    """POST /v1/score: /score, with vLLM's warning."""
    logger.warning(
        "To indicate that Score API is not part of standard OpenAI API, we have moved it to "
        "`/score`. Please update your client accordingly."
    )
    return await create_score(request)


async def create_rerank(request: web.Request) -> web.Response:
    """The /rerank (/v2/rerank) handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    check_serving(state, body)
    fields = BodyFields(body, RERANK_BODY)
    top_n = fields.get("top_n", 0)
    if top_n < 0:
        raise bad_parameter("top_n", top_n, "top_n must be at least 0")
    inputs = read_rerank_inputs(body, _architecture(state))
    log_ignored_fields(body, RERANK_FIELDS)
    head, scores, num_tokens = await _score(state, request, fields, inputs)
    answer = rerank_response(head, inputs.documents, scores, top_n, num_tokens)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


_warned_v1_rerank = False


async def create_rerank_v1(request: web.Request) -> web.Response:
    """POST /v1/rerank: /rerank, with vLLM's warning (once)."""
    global _warned_v1_rerank
    if not _warned_v1_rerank:
        _warned_v1_rerank = True
        logger.warning(
            "To indicate that the rerank API is not part of the standard OpenAI API, we have "
            "located it at `/rerank`. Please update your client accordingly. (Note: Conforms "
            "to JinaAI rerank API)"
        )
    return await create_rerank(request)


def _architecture(state: ServerState) -> str:
    architectures = getattr(state.engine.hf_config, "architectures", None) or ["this model"]
    return architectures[0]


async def _score(
    state: ServerState, request: web.Request, fields: BodyFields, inputs: ScoringInputs
) -> tuple[ResponseHead, list[float], int]:
    """Every pair's score and the prompt tokens counted, by the model's task: an embedding
    model's cosines of the texts' vectors, a cross-encoder's scores of the pairs."""
    engine = state.engine
    common = read_pooling_request(state, fields, request.headers)
    max_model_len = engine.settings.max_model_len
    limits = (
        read_token_limit(fields, "max_tokens_per_query", max_model_len),
        read_token_limit(fields, "max_tokens_per_doc", max_model_len),
    )
    task = pooling_task(engine)
    params = PoolingParams(task=task, use_activation=common.use_activation)
    head = ResponseHead.new(f"score-{common.request_id}", "list", state.model_name)
    num_prompts = len(inputs.documents)
    if task != "classify":
        num_prompts += len(inputs.queries)
    with reserve_places(engine, num_prompts) as reservation:
        if task == "classify":
            prompts = await state.off_loop(
                encode_pairs,
                tokenizer_of(state),
                inputs.queries,
                inputs.documents,
                max_length=common.tokenizer_max_length,
                max_query_tokens=limits[0],
                max_doc_tokens=limits[1],
            )
        else:
            prompts = await _text_prompts(state, inputs, common.tokenizer_max_length, limits)
        prompts = checked_prompts(engine, prompts, common.truncation, params)
        outputs = await encode_all(engine, prompts, params, head.id, common, reservation)
    if task == "classify":
        scores = [pair_score(output) for output in outputs]
    else:
        scores = _cosines(outputs, len(inputs.queries))
    return head, scores, sum(len(output.prompt_token_ids) for output in outputs)


async def _text_prompts(
    state: ServerState, inputs: ScoringInputs, max_length: int | None, limits: tuple[int, int]
) -> list[Prompt]:
    """A bi-encoder's prompts: every query's and document's tokens, queries first."""
    texts = [*inputs.queries, *inputs.documents]
    if any(limits):
        texts = await state.off_loop(_truncated_texts, state, inputs, *limits)
    token_ids = await tokenize_texts(state, texts, True, max_length)
    cut = max_length is not None
    return [Prompt(text, ids, cut=cut) for text, ids in zip(texts, token_ids, strict=True)]


def _truncated_texts(
    state: ServerState, inputs: ScoringInputs, max_query_tokens: int, max_doc_tokens: int
) -> list[str]:
    tokenizer = tokenizer_of(state)

    def cut(texts: list[str], limit: int) -> list[str]:
        return [truncate_text(tokenizer, t, limit) for t in texts] if limit else texts

    return [*cut(inputs.queries, max_query_tokens), *cut(inputs.documents, max_doc_tokens)]


def _cosines(outputs: list[PoolingRequestOutput], num_queries: int) -> list[float]:
    vectors = [output.data for output in outputs]
    return pair_scores(vectors[:num_queries], vectors[num_queries:])


def add_scoring_routes(app: web.Application) -> None:
    """Register /score, /v1/score, /rerank, /v1/rerank and /v2/rerank on `app`."""
    app.router.add_post("/score", create_score)
    app.router.add_post("/v1/score", create_score_v1)
    app.router.add_post("/rerank", create_rerank)
    app.router.add_post("/v1/rerank", create_rerank_v1)
    app.router.add_post("/v2/rerank", create_rerank)
